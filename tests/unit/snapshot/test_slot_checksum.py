"""The memory slot's tensor checksum: a CRC-32C per block
(:func:`ddpkit.snapshot._slots.block_crcs`). Every change of 1, 2 or 3 bits and every burst of
up to 32 bits in a slot's tensor bytes, anywhere, across block boundaries too, is refused by the
slot reader. Control: changes that cancel within one block (+x in one int64 word, -x in another)
passed the block sums before (kept here as ``block_sums``), and are refused now.
"""

from __future__ import annotations

import random
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from ddpkit.snapshot import _slots as ms
from ddpkit.snapshot import _slots as mslot

SIZE = 3 * mslot.BLOCK + 4096 + 8  # four blocks, the last one short


def block_sums(region: bytes) -> int:
    """The checksum of slot format 2: the CRC-32 of the wrapping int64 sums of the region's 4 KiB
    blocks."""
    words = np.frombuffer(region, dtype=np.int64)
    full = (words.size * 8 // 4096) * 512
    sums = words[:full].reshape(-1, 512).sum(1, dtype=np.int64)
    tail = words[full:].sum(dtype=np.int64, keepdims=True)
    return zlib.crc32(tail, zlib.crc32(sums))


@pytest.fixture(scope="module")
def slot(tmp_path_factory) -> tuple[bytes, int]:
    """A slot's bytes as a save writes them, holding SIZE random bytes, and its data region's
    offset."""
    folder = tmp_path_factory.mktemp("slots")
    st = ms.Slots(folder, job="job-a", run="run-a", rank=0, world_size=1)
    weights = torch.from_numpy(np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8))
    manifest = {"specs": [["torch.uint8", [SIZE], 0]], "data_size": SIZE}
    st.save(
        {"step": 1, "position": [0, 1, 1], "peers": False, "values": None},
        [weights],
        manifest,
        "layout",
    )
    st.close()
    (path,) = folder.glob("*.slot")
    data = path.read_bytes()
    record = mslot.Record.unpack(data[: mslot.HEADER])
    assert record is not None and record.data[1] == SIZE
    got = mslot.parse_slot(data)  # the slot as saved reads back
    assert got is not None and torch.equal(mslot.tensors_of(got[3], got[0], got[1])[0], weights)
    return data, record.data[0]


def flip(raw: bytearray, start: int, bits: list[int]) -> None:
    """Flip the given bits of the region at ``start`` of ``raw`` (bit 8*i + k is bit k of byte
    i)."""
    for bit in bits:
        raw[start + bit // 8] ^= 1 << (bit % 8)


def flipped(data: bytes, start: int, bits: list[int]) -> bytes:
    raw = bytearray(data)
    flip(raw, start, bits)
    return bytes(raw)


def refused(data: bytes | bytearray) -> bool:
    try:
        # a bytearray reads as bytes do
        mslot.parse_slot(data, "the slot")  # type: ignore[arg-type]
    except mslot.BadSlot as err:
        assert "its tensors' bytes fail their checksum" in str(err)
        return True
    return False


def refused_flipped(raw: bytearray, start: int, bits: list[int]) -> bool:
    """:func:`refused` of ``raw`` with ``bits`` flipped; ``raw`` is left as it was (no copy of the
    slot)."""
    flip(raw, start, bits)
    try:
        return refused(raw)
    finally:
        flip(raw, start, bits)


def edges() -> list[int]:
    """Bits near every block boundary and the region's ends."""
    bits = SIZE * 8
    near = [b * mslot.BLOCK * 8 + d for b in range(1, 4) for d in (-2, -1, 0, 1)]
    return [0, 1, bits - 1, bits - 2, *near]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_change_of_up_to_3_bits_in_the_tensor_bytes_is_refused(slot, n):
    data, start = slot
    raw = bytearray(data)
    rng = random.Random(n)
    bits = SIZE * 8
    cases = [rng.sample(range(bits), n) for _ in range(1000)]
    # Bits in one block close together, in neighbouring blocks across a boundary, and at the
    # region's ends.
    cases += [rng.sample(edges(), n) for _ in range(200)]
    near = rng.randrange(bits - 64)
    cases += [[near + d for d in rng.sample(range(64), n)] for _ in range(200)]
    for case in cases:
        assert refused_flipped(raw, start, case), f"bits {sorted(case)} flipped passed the checksum"


def test_every_burst_of_up_to_32_bits_in_the_tensor_bytes_is_refused(slot):
    data, start = slot
    raw = bytearray(data)
    rng = random.Random(32)
    boundaries = [b * mslot.BLOCK * 8 for b in range(1, 4)]
    for length in range(1, 33):
        starts = [rng.randrange(SIZE * 8 - length + 1) for _ in range(20)]
        # straddling a boundary
        starts += [rng.choice(boundaries) - rng.randrange(length) for _ in range(20)]
        starts += [0, SIZE * 8 - length]
        for first in starts:
            # A burst: its first and last bits flipped, any in between.
            inner = [first + i for i in range(1, length - 1) if rng.random() < 0.5]
            case = sorted({first, first + length - 1, *inner})
            assert refused_flipped(raw, start, case), (
                f"a burst of {length} bits at bit {first} passed"
            )


def test_changes_that_cancel_within_a_block_passed_the_block_sums_and_are_refused(slot):
    data, start = slot
    region = data[start : start + SIZE]
    rng = random.Random(5)
    for _ in range(50):
        block = rng.randrange(SIZE // 4096)
        i, j = (block * 512 + w for w in rng.sample(range(512), 2))
        x = np.uint64(rng.randrange(1, 2**64))
        raw = bytearray(data)
        words = np.frombuffer(raw, dtype=np.uint64, count=SIZE // 8, offset=start)
        words[i : i + 1] += x  # modulo 2**64, as the sums wrap
        words[j : j + 1] -= x
        changed = bytes(raw)
        assert changed[start : start + SIZE] != region
        # Control: slot format 2's checksum did not see it (changed weights loaded as whole).
        assert block_sums(changed[start : start + SIZE]) == block_sums(region)
        assert refused(changed)
    # The same with 2 bits: bit k set in one word and cleared in another of the same 4 KiB block.
    words = np.frombuffer(region, dtype=np.int64)
    i = next(i for i in range(512) if words[i] & 1 == 0)
    j = next(j for j in range(512) if words[j] & 1 == 1)
    changed = flipped(data, start, [64 * i, 64 * j])
    assert block_sums(changed[start : start + SIZE]) == block_sums(region)  # control
    assert refused(changed)


def test_a_slot_file_with_a_flipped_bit_is_refused_naming_it_and_one_with_its_table_changed_too(
    slot, tmp_path
):
    data, start = slot
    path = tmp_path / "run-a-rank0-0.slot"
    path.write_bytes(flipped(data, start, [5 * 8 * 4096 + 3]))
    with pytest.raises(mslot.BadSlot, match=f"{path}: its tensors' bytes fail their checksum"):
        mslot.read_slot(path, data=True)
    table_at = start + SIZE
    path.write_bytes(flipped(data, table_at, [7]))
    with pytest.raises(
        mslot.BadSlot, match=f"{path}: its table of the tensors' checksums fails its CRC-32C"
    ):
        mslot.read_slot(path, data=True)
    path.write_bytes(data[: table_at + 8])  # the table cut short
    with pytest.raises(
        mslot.BadSlot, match=f"{path}: its data region .* lies past the end of the file"
    ):
        mslot.read_slot(path, data=True)
    path.write_bytes(data)  # control: the same file unchanged reads back
    assert mslot.read_slot(path, data=True) is not None


# The generator polynomial of CRC-32C (Castagnoli), x**32 + ..., without its x**32 term.
CASTAGNOLI = 0x1EDC6F41


def _times_x_power(e: int) -> int:
    """x**e modulo the polynomial, over GF(2), by squaring."""
    poly = (1 << 32) | CASTAGNOLI

    def mul(a: int, b: int) -> int:
        out = 0
        while b:
            if b & 1:
                out ^= a
            b >>= 1
            a <<= 1
            if a >> 32:
                a ^= poly
        return out

    result, base = 1, 2
    while e:
        if e & 1:
            result = mul(result, base)
        base, e = mul(base, base), e >> 1
    return result


def test_the_block_size_is_within_crc32cs_distance_4_length():
    """The bound the checksum's guarantee rests on, derived rather than copied: the polynomial has
    the factor x+1 (an even number of terms: every odd number of flipped bits is seen) and x's
    period modulo it is 2**31 - 1 (a Mersenne prime, so x**(2**31 - 1) == 1 makes it exactly that:
    no two flips closer than that cancel). So distance 4 holds for codewords up to 2**31 - 1 bits,
    data and 32 check bits: Koopman's 2,147,483,615 data bits."""
    import crc32c

    # the package's CRC is CRC-32C (its published check value)
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    assert (bin(CASTAGNOLI).count("1") + 1) % 2 == 0
    assert _times_x_power(2**31 - 1) == 1 and _times_x_power(1) != 1
    assert mslot.BLOCK * 8 <= 2**31 - 1 - 32 == 2_147_483_615


@pytest.mark.heavy
def test_import_ddpkit_does_not_load_the_crc_package():
    code = (
        "import sys, ddpkit, ddpkit.snapshot._slots; assert 'crc32c' not in sys.modules, 'loaded'"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
