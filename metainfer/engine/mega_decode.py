"""Batch-1 decode steps through the megakernel (EngineConfig.megakernel; kernels/mega).

The program (build_step.decode_program) is built once over the model's weights and the runner's caches,
with its own persistent step inputs: the step vector (token, position, KV slot, state slot, has-state,
sequence length), the sequence's block table and the logits row. A step writes those inputs (the
token on the device when it is still PENDING: the previous step's sampled row), then runs the program:
one cooperative launch on CUDA (MegaKernel), the PyTorch emulator elsewhere (so the engine path is
testable on the CPU). The caller samples from the returned logits as from any step's.

Serves a step with one sequence decoding one token; any other step takes the runner's usual paths.
No hidden states come out (the MTP drafter's input), hence no speculation with it (EngineConfig).
"""

from __future__ import annotations

import os

import torch

from metainfer.kernels.mega import build_step, emulate
from metainfer.kernels.mega import program as P
from metainfer.model.meta import CacheTensors

MMA_ENV = "METAINFER_MEGA_MMA"  # "1": the e4m3 tiles on the tensor cores (2026-12-02b: the same step time)
LEAD_ENV = "METAINFER_MEGA_LEAD"  # bytes per CTA of L2 lead before each routing wait (0: off)


def splits_for(max_model_len: int) -> int:
    """KV splits per attention head: 8 (128 of the 132 SMs busy), more where a split would score over
    program.MAX_SCORES positions."""
    return max(8, -(-max_model_len // P.MAX_SCORES))


class MegaDecode:
    def __init__(self, model, caches: CacheTensors, blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.step_vec = torch.zeros(P.STEP_WORDS, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(blocks_per_seq, dtype=torch.int32, device=device)
        self.logits = torch.zeros(model.cfg.vocab_size, dtype=torch.float32, device=device)
        instrs = build_step.decode_program(model, caches, self.block_table, self.logits,
                                           splits=splits_for(max_model_len))
        self.program = P.Program(instrs, step=self.step_vec)
        self.kernel = None
        self.mma = os.environ.get(MMA_ENV, "0") == "1"  # the tensor-core consumers (MegaKernel.launch)
        if device.type == "cuda":
            from metainfer.kernels.mega.launch import MegaKernel

            self.kernel = MegaKernel(device)
            self.kernel.load(self.mma)  # that build now, not at a first launch inside a graph capture
            self.kernel.prepare(self.program)  # (its TMA maps too)
        self.steps = 0  # steps served
        self._table: list[int] | None = None  # the block ids now in block_table
        self.lead = int(os.environ.get(LEAD_ENV, "0") or 0)  # the L2 lead, bytes per CTA

    def run(self, token: int | None, position: int, block_ids: list[int], state_slot: int,
            token_src: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of the sequence at `position` (its token there: `token`, or None with
        token_src a [1] int64 device tensor holding it). -> logits [1, V] fp32 (a view of this
        object's buffer: valid until the next run)."""
        bs = self.block_size
        kv_slot = block_ids[position // bs] * bs + position % bs
        build_step.step_inputs(self.step_vec, 0 if token is None else token, position, kv_slot, state_slot,
                               position > 0, position + 1)
        if token is None:
            self.step_vec[P.STEP_TOKEN : P.STEP_TOKEN + 1].copy_(token_src)
        if block_ids != self._table:  # a new block or a new sequence: the device table again
            table = torch.zeros(self.block_table.numel(), dtype=torch.int32)
            table[: len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
            self.block_table.copy_(table)
            self._table = list(block_ids)
        if self.kernel is not None:
            self.kernel.launch(self.program, lead=self.lead, mma=self.mma)
            if self.steps < 4 or self.steps % 256 == 0:  # the watchdog's word (a sync): early, then rarely
                err = self.program.error()
                if err:
                    raise RuntimeError(f"megakernel step {self.steps}: {err}")
        else:
            emulate.run(self.program.instrs, self.step_vec)
        self.steps += 1
        return self.logits.view(1, -1)
