"""The plain per-request loop that mirrors docs/contract.md §1 line by line: the oracle
for the vectorised ledger. Deliberately naive: cursors, appends, no numpy
tricks."""
from __future__ import annotations

from engine.host.param_records import derive_seed
from engine.host.params import SeqMeta


def reference_ledger(seqs: list[SeqMeta], *, max_draft_tokens: int = 0, compaction_keep_tokens: int | None = None, seed_base: int = 0) -> dict:
    out_cursor = 0  # read cursor over model-output rows
    query_cursor = 0  # read cursor over query tokens
    sel, row_to_req, local_step, eos_rows = [], [], [], []
    prompt_sel, prompt_targets = [], []
    positions, temps, top_ks, top_ps, min_ps, seeds = [], [], [], [], [], []
    mtp_first, mtp_seqlens, mtp_write, mtp_read = [], [], [], []
    forced = []  # per sample row: the request's forced token on its first row, else -1
    any_prompt_lp = False
    for i, s in enumerate(seqs):
        p = s.params
        last_chunk = s.is_prompt and s.seqlen_k == s.prompt_len
        out_len = s.seqlen_q
        if s.is_prompt and compaction_keep_tokens is not None:
            q_start = s.seqlen_k - s.seqlen_q
            clip = min(max(s.prompt_len - compaction_keep_tokens - q_start, 0), s.seqlen_q - 1)
            out_len = s.seqlen_q - clip
        if s.is_prompt:
            rows = [out_cursor + out_len - 1]
            positions.append(s.seqlen_k)
        else:
            rows = [out_cursor + j for j in range(s.seqlen_q)]
            positions.append(s.seqlen_k - s.seqlen_q + 1)
        # A non-last chunk's row produces no token, so it never needs EOS suppression.
        produces_token = not s.is_prompt or last_chunk
        for j, r in enumerate(rows):
            if produces_token and s.num_generated + j < p.min_tokens:
                eos_rows.append(len(sel))
            sel.append(r)
            row_to_req.append(i)
            local_step.append(j)
            forced.append(s.forced_token if j == 0 and s.forced_token is not None else -1)
        if s.is_prompt and p.num_prompt_logprobs >= 0:
            any_prompt_lp = True
            n = s.seqlen_q - (1 if last_chunk else 0)
            for j in range(n):
                prompt_sel.append(out_cursor + j)
                prompt_targets.append(int(s.prompt_tokens[s.seqlen_k - s.seqlen_q + j + 1]))
        temps.append(p.temperature)
        top_ks.append(p.top_k)
        top_ps.append(p.top_p)
        min_ps.append(p.min_p)
        seeds.append(p.seed if p.seed is not None else derive_seed(s.request_id, seed_base))
        if max_draft_tokens > 0:
            mtp_first.append(rows[0])
            mtp_seqlens.append(len(rows))
            mtp_write.append(0 if (s.is_prompt and not last_chunk) else s.mtp_write_slot)
            for j in range(len(rows)):
                if not s.is_prompt and j < s.seqlen_q - 1:
                    mtp_read.append(s.mtp_read_slot * max_draft_tokens + j)
                else:
                    mtp_read.append(0)
        out_cursor += out_len
        query_cursor += s.seqlen_q
    return dict(
        selected_token_indices=sel,
        selected_prompt_indices=prompt_sel if any_prompt_lp else None,
        prompt_token_targets=prompt_targets if any_prompt_lp else None,
        sample_positions=positions,
        row_to_req=row_to_req,
        local_step=local_step,
        temperatures=temps,
        top_ks=top_ks,
        top_ps=top_ps,
        min_ps=min_ps,
        seeds=seeds,
        eos_suppression_rows=eos_rows,
        mtp_first_token_positions=mtp_first if max_draft_tokens > 0 else None,
        mtp_seqlens_q=mtp_seqlens if max_draft_tokens > 0 else None,
        mtp_info_write_slots=mtp_write if max_draft_tokens > 0 else None,
        mtp_info_read_rows=mtp_read if max_draft_tokens > 0 else None,
        forced_tokens=forced if any(s.forced_token is not None for s in seqs) else None,
        num_output_rows=out_cursor,
        num_query_tokens=query_cursor,
    )
