"""The memory-snapshot job (:mod:`tests.jobs.scripts.memory_job`) whose rank 0, on its first
attempt, damages its own slot right after saving a given step, then dies of SIGKILL: the restart
finds a whole slot (its commit record, manifest and values check) that lies.

    python -m tests.jobs.scripts.damaged_memory_job RUN_DIR --log DIR [memory_job's options]

``DDPKIT_TEST_DAMAGE=MODE:STEP``, MODE one of

- ``weight``: the first float of the data region (a weight of the first layer) set to 999.9;
- ``manifest``: the manifest rewritten, its CRC-32 too, so that the first tensor lies past the data
  region;
- ``both``: ``weight`` in both of rank 0's slots (the step saved and the one before).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import zlib
from pathlib import Path
from typing import Any

import ddpkit.snapshot._slots as ms
import ddpkit.snapshot._slots as mslot
from tests.jobs.scripts import memory_job


def _lie_about_weight(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    record = mslot.Record.unpack(bytes(raw[: mslot.HEADER]))
    assert record is not None and record.whole
    at = record.data[0]
    raw[at : at + 4] = struct.pack("<f", 999.9)
    path.write_bytes(bytes(raw))


def _lie_about_layout(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    record = mslot.Record.unpack(bytes(raw[: mslot.HEADER]))
    assert record is not None and record.whole
    off, length, _ = record.manifest
    manifest = json.loads(raw[off : off + length])
    manifest["specs"][0][2] = record.data[1] + 64  # past the data region
    # compact, where the slot's own is not: the lie's longer number fits whatever the padding
    text = json.dumps(manifest, separators=(",", ":")).encode()
    assert len(text) <= record.values[0] - off  # room before the values
    raw[off : off + len(text)] = text
    lied = mslot.Record(
        record.begin, record.end, (off, len(text), zlib.crc32(text)), record.values, record.data
    )
    raw[: len(lied.pack())] = lied.pack()
    path.write_bytes(bytes(raw))


def main() -> None:
    mode, step = os.environ["DDPKIT_TEST_DAMAGE"].split(":")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    save = ms.Slots.save

    def damaging_save(self: ms.Slots, values: dict[str, Any], *args: Any) -> None:
        save(self, values, *args)
        if not (first_attempt and self.rank == 0 and values["step"] == int(step)):
            return
        slots = sorted(
            (s for s in self.slots if s.record is not None),
            key=lambda s: s.record.end,
            reverse=True,
        )
        for slot in slots[: 2 if mode == "both" else 1]:
            (_lie_about_layout if mode == "manifest" else _lie_about_weight)(slot.path)
        os.kill(os.getpid(), signal.SIGKILL)

    ms.Slots.save = damaging_save  # type: ignore[method-assign]
    memory_job.main()


if __name__ == "__main__":
    main()
