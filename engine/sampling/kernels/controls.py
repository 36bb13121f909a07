"""The sampling controls' launcher: `apply_controls` (torch op `engine::apply_controls`) runs
the kernel (`engine.sampling.kernels.controls_kernel`, whose docstring has the design) over a
bucket's rows, `PassOne` holds what it hands the sampler, and `AOT_BUILDS` lists its
ahead-of-time builds for sm_90.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch.library import triton_op, wrap_triton

from engine.sampling.kernels import FP_FUSION, interpreting
from engine.sampling.kernels.controls_kernel import BIAS_BLOCK, BLOCK, NUM_WARPS, PROGRAMS_PER_LAUNCH, controls_kernel
from engine.sampling.thresholds import mass_bits


def _split(rows: int, vocab: int, block: int, programs: int) -> tuple[int, int]:
    """(programs per row, tokens per program): about `programs` programs in all, whole BLOCKs each."""
    split = max(1, min(-(-programs // max(rows, 1)), -(-vocab // block), 1 << 14))
    chunk = -(-(-(-vocab // split)) // block) * block
    return -(-vocab // chunk), chunk


def _check(logits: torch.Tensor, out: torch.Tensor, counts: torch.Tensor, prompt_words: torch.Tensor,
           stop_ids: torch.Tensor, token_bitmask: torch.Tensor | None) -> None:
    rows, vocab = logits.shape
    for name, tensor, dtype in (("logits", logits, torch.float32), ("out", out, torch.float32),
                                ("counts", counts, torch.int32), ("prompt_words", prompt_words, torch.int32)):
        if tensor.dtype != dtype or tensor.stride(-1) != 1:
            raise ValueError(f"apply_controls: {name} is {tensor.dtype} with strides {tensor.stride()}, "
                             f"expected {dtype} with unit token stride")
    # The bias pass and a failed row's rewrite read the logits again after `out` is written.
    # A storage at address 0 has no memory (a fake tensor of the dry run): nothing to share.
    base = out.untyped_storage().data_ptr()
    if base != 0 and base == logits.untyped_storage().data_ptr():
        raise ValueError("apply_controls: out shares its memory with logits; it must be a separate buffer")
    if out.shape != logits.shape or counts.shape[1] != vocab:
        raise ValueError(f"apply_controls: out {tuple(out.shape)} / counts {tuple(counts.shape)} do not match "
                         f"logits {tuple(logits.shape)}")
    words = prompt_words.shape[1]
    if token_bitmask is not None and (token_bitmask.shape != (rows, words) or not token_bitmask.is_contiguous()):
        raise ValueError(f"apply_controls: token_bitmask {tuple(token_bitmask.shape)}, expected a contiguous "
                         f"[{rows}, {words}] int32")
    if stop_ids.dim() != 2 or not stop_ids.is_contiguous():
        raise ValueError(f"apply_controls: stop_ids {tuple(stop_ids.shape)}: expected a contiguous [reqs, S]")


@dataclass
class PassOne:
    """What the sampler's pass 1 finds of a row (engine/sampling/kernels/sample_kernel.py),
    found by the controls kernel as it writes the row's scores, so that the sampler reads a
    controlled row's scores and logits once less: per row the masked maximum M of the
    controlled scores and its first index, the logits' maximum, whether one is not finite and
    their top-N rank keys; per program of the controls' launch its partials (merged by the
    row's last program). Allocated once for the largest bucket."""

    row_f: torch.Tensor  # [rows, 2] f32: M, the logits' maximum
    row_i: torch.Tensor  # [rows, 3] int64: M's first index, 1 if a logit is not finite, the raw masses' sum
    row_top: torch.Tensor  # [rows, top] int64: the logits' top-N rank keys (raw logprobs)
    part_f: torch.Tensor  # [slots, 2] f32: each program's partials, as row_f
    part_i: torch.Tensor  # [slots, 3] int64: as row_i
    part_top: torch.Tensor  # [slots, top] int64: as row_top

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device | str, num_top: int = 0,
                 programs: int = PROGRAMS_PER_LAUNCH, block: int = BLOCK) -> PassOne:
        """For up to `rows` rows of V = `vocab`, top-N lists of up to `num_top`, launches of
        `programs` programs and `block` tokens a step (`apply_controls`' own)."""
        slots = max(r * _split(r, vocab, block, programs)[0] for r in range(1, rows + 1))
        top = triton.next_power_of_2(max(num_top, 1))
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        return cls(row_f=torch.zeros(rows, 2, **f32), row_i=torch.zeros(rows, 3, **i64),
                   row_top=torch.zeros(rows, top, **i64), part_f=torch.zeros(slots, 2, **f32),
                   part_i=torch.zeros(slots, 3, **i64), part_top=torch.zeros(slots, top, **i64))


@triton_op("engine::apply_controls",
           mutates_args={"out", "row_controlled", "nothing_allowed", "arrivals", "resolved_drafts", "pass_f",
                         "pass_i", "pass_top", "part_f", "part_i", "part_top"})
def apply_controls(
    logits: torch.Tensor,
    out: torch.Tensor,
    row_controlled: torch.Tensor,
    nothing_allowed: torch.Tensor,
    arrivals: torch.Tensor,
    resolved_drafts: torch.Tensor,
    row_to_req: torch.Tensor,
    local_step: torch.Tensor,
    control_slots: torch.Tensor,
    row_drafts: torch.Tensor,
    read_rows: torch.Tensor,
    pool_tokens: torch.Tensor,
    counts: torch.Tensor,
    prompt_words: torch.Tensor,
    penalties: torch.Tensor,
    bias_ids: torch.Tensor,
    bias_values: torch.Tensor,
    allowed_words: torch.Tensor,
    restricted: torch.Tensor,
    stop_ids: torch.Tensor,
    eos_suppression_rows: torch.Tensor,
    token_bitmask: torch.Tensor | None,
    masked_rows: torch.Tensor | None,
    max_drafts: int,
    programs: int = PROGRAMS_PER_LAUNCH,
    block: int = BLOCK,
    bias_block: int = BIAS_BLOCK,
    pass_f: torch.Tensor | None = None,
    pass_i: torch.Tensor | None = None,
    pass_top: torch.Tensor | None = None,
    part_f: torch.Tensor | None = None,
    part_i: torch.Tensor | None = None,
    part_top: torch.Tensor | None = None,
    raw_top: bool = False,
    raw_max: torch.Tensor | None = None,
) -> None:
    """The sampling controls of every sample row in one kernel (see the module docstring).

    Parameters, all on the logits' device:
    - `logits` [rows, V] f32, read only: the LM head's logits (stay unprocessed);
    - `out` [rows, V] f32: the controlled scores of each row with `row_controlled`;
    - `row_controlled` [rows] bool (written): the row had controls and `out` holds it;
      False: `out` is untouched and the row's scores are `logits` themselves;
    - `nothing_allowed` [rows] bool (written): the bitmask allows no finite score
      (`RowError.NO_TOKEN_ALLOWED`; `out` then holds the row without the bitmask);
    - `arrivals` [rows] int32 scratch, zero before and after the launch;
    - `resolved_drafts` [rows] int64 (written when `max_drafts` > 0): each row's draft;
    - `row_to_req`, `local_step` [rows] int64; `control_slots` [reqs] int64 (0 = none);
    - `row_drafts` [rows] int64 (-1 none, -2 from the pool), `read_rows` [rows] int64
      (`mtp_info_read_rows`), `pool_tokens` [pool rows] int64: read when `max_drafts` > 0;
    - the control slots' state (`engine/step/control_state.py`): `counts` [slots, V] int32,
      `prompt_words` [slots, W] int32, `penalties` [slots, 3] f32 (repetition,
      frequency, presence), `bias_ids` [slots, L] int64 and `bias_values` [slots, L]
      f32 (padding (0, +0.0) after the real entries, whose ids are distinct),
      `allowed_words` [slots, W] int32, `restricted` [slots] bool;
    - `stop_ids` [reqs, S] int64 (-1 none), `eos_suppression_rows` [rows] bool;
    - `token_bitmask` [rows, W] int32 or None; `masked_rows` [rows] bool or None: the
      rows whose bitmask restricts (None: every row of a given bitmask);
    - `max_drafts`: drafts a request verifies at most (the rows a row looks back);
    - `programs`: about how many programs the launch spreads over; `block`: tokens per step;
      `bias_block`: logit-bias entries per step (powers of two);
    - `pass_f` ... `part_top`: a `PassOne`'s fields, or None: each controlled row's results
      of the sampler's pass 1 (written), for `sample_rows(handed=...)`; `raw_top`: its
      top-N too (raw logprobs); `raw_max` [rows] int64 or None: each row's largest logit as
      the LM head keyed it (`row_max_keys`), read to sum the raw masses into the PassOne
      too, then set to 0 for the next step's LM head (every row, controlled or not).
    Returns: None. Raises: ValueError on a dtype, layout or shape it cannot read.
    Capture-safe: no host sync, fixed grid for fixed shapes.
    """
    _check(logits, out, counts, prompt_words, stop_ids, token_bitmask)
    rows, vocab = logits.shape
    if rows == 0:
        return
    split, chunk = _split(rows, vocab, block, programs)
    handoff = pass_f is not None
    if handoff and (pass_f.shape[0] < rows or part_f.shape[0] < rows * split):
        raise ValueError(f"apply_controls: PassOne of {pass_f.shape[0]} rows and {part_f.shape[0]} part slots, "
                         f"expected at least {rows} and {rows * split} (PassOne.allocate with the launch's programs)")
    if raw_max is not None and not (handoff and raw_top):
        raise ValueError("apply_controls: raw_max without a PassOne and raw_top=True: the sampler ranks a token "
                         "whose raw masses were handed over from the handed raw top-N")
    top_pad = 1 if pass_top is None else pass_top.shape[1]
    num_stops = stop_ids.shape[1]
    wrap_triton(controls_kernel)[(rows, split)](
        logits, out, row_controlled, nothing_allowed, arrivals, resolved_drafts,
        row_to_req, local_step, control_slots, row_drafts, read_rows, pool_tokens,
        counts, prompt_words, penalties, bias_ids, bias_values, allowed_words, restricted,
        stop_ids, eos_suppression_rows,
        prompt_words if token_bitmask is None else token_bitmask,  # never read without a bitmask
        eos_suppression_rows if masked_rows is None else masked_rows,
        *((pass_f, pass_i, pass_top, part_f, part_i, part_top) if handoff else (logits,) * 6),  # never read without
        logits if raw_max is None else raw_max,
        vocab, prompt_words.shape[1], bias_ids.shape[1], chunk, logits.stride(0), out.stride(0),
        BLOCK=block, BIAS_BLOCK=bias_block, MAX_DRAFTS=max_drafts, DRAFT_P2=triton.next_power_of_2(max(max_drafts, 1)),
        NUM_STOPS=num_stops, STOP_P2=triton.next_power_of_2(num_stops), HAS_BITMASK=token_bitmask is not None,
        HAS_MASKED_ROWS=token_bitmask is not None and masked_rows is not None,
        **_handoff_constants(vocab, block, top_pad, handoff, handoff and raw_top, raw_max is not None),
        num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
    )


def _handoff_constants(vocab: int, block: int, top_pad: int, handoff: bool, raw_top: bool,
                       raw_mass: bool) -> dict[str, object]:
    """The launch's PassOne constants: the merge is as wide as the most programs a row of V can
    have (one build per vocabulary, whatever the bucket)."""
    id_bits = max(1, (vocab - 1).bit_length())
    return dict(HANDOFF=handoff, RAW_TOP=raw_top, TOP_PAD=top_pad, ID_BITS=id_bits, ID_MASK=(1 << id_bits) - 1,
                PARTS_PAD=triton.next_power_of_2(-(-vocab // block)) if handoff else 1, RAW_MASS=raw_mass,
                MASS_SCALE=2.0 ** mass_bits(vocab), ACCURATE=not interpreting())


def _aot_builds() -> list[dict[str, object]]:
    """What the CUDA step launches, for `profiling.kernel_build`: both real vocabularies, 8 stop
    ids (`EngineConfig.max_stop_ids`), with 3 drafts and a bitmask with its row flags, and plainly."""
    pointers = dict(logits_ptr="*fp32", out_ptr="*fp32", row_controlled_ptr="*i1", nothing_allowed_ptr="*i1",
                    arrivals_ptr="*i32", counts_ptr="*i32", prompt_words_ptr="*i32", penalties_ptr="*fp32",
                    bias_values_ptr="*fp32", allowed_words_ptr="*i32", restricted_ptr="*i1", eos_rows_ptr="*i1",
                    bitmask_ptr="*i32", masked_rows_ptr="*i1", pass_f_ptr="*fp32", part_f_ptr="*fp32",
                    raw_max_ptr="*i64")
    signature = {name: "constexpr" if name.isupper() else pointers.get(name, "*i64" if name.endswith("_ptr") else "i32")
                 for name in controls_kernel.arg_names}
    builds = []
    for vocab in (129280, 49152):
        for drafts, bitmask in ((3, True), (0, False)):
            # The kernel head's launch: the sampler's pass 1 handed over, with raw logprobs' top-20.
            constexprs = dict(BLOCK=BLOCK, BIAS_BLOCK=BIAS_BLOCK, MAX_DRAFTS=drafts,
                              DRAFT_P2=triton.next_power_of_2(max(drafts, 1)), NUM_STOPS=8, STOP_P2=8,
                              HAS_BITMASK=bitmask, HAS_MASKED_ROWS=bitmask,
                              **_handoff_constants(vocab, BLOCK, 32, True, True, True))
            builds.append(dict(name=f"apply_controls V={vocab} drafts={drafts}{' bitmask' if bitmask else ''}",
                               fn=controls_kernel, signature=signature, constexprs=constexprs, num_warps=NUM_WARPS))
    return builds


AOT_BUILDS = _aot_builds()
