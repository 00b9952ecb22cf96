"""The Trainer: its config, state, step loop, callbacks, evaluation and losses."""
