"""Log probabilities of emitted tokens (OpenAI's ``logprobs``), from the verification forward.

Which distribution: the target's **raw** one, the log-softmax of its logits before any
processing (temperature, penalties, logit_bias, top-k/p, min_p), as vLLM's default
``logprobs_mode="raw_logprobs"`` and as OpenAI reports (model logprobs, also at temperature 0).
The processed distribution would be -inf for every token but one of a greedy row, and the
sampling options are the client's own, so it could compute them; the raw one says what the
model thought. It is also what "exact" speculative decoding preserves: every method emits
tokens whose raw logprobs are the target alone's, since the logits are the target's at the
same prefix.

Cost: only rows that ask pay. Their rows of the target logits, already on the device from the
verification forward, get one log-softmax, a gather and a top-n; the result is copied to the
host without blocking before the step's one host sync, so a step still syncs once.

Prompt logprobs (OpenAI's ``echo`` with ``logprobs``, ``prompt_logprobs=`` of the Python API)
come from the chunked prefill, in the same raw mode. A prefill forward asks the model for the
last position's logits only; rows that want their prompt's logprobs run in a forward of their
own that keeps every position's (:func:`osd.decode.prompt_logprobs.prefill_target`), so the
other rows' forward is what it was. Each chunk's logprobs are copied without blocking, like a
step's, and read after the sync that samples the row's first token (:class:`PromptLogprobs`).
Their memory: the asking rows' chunks padded to the longest, (rows x longest chunk x
vocabulary) float32, twice while the log-softmax is taken; the batched loop's prefill budget
bounds a chunk, the Python API's ``generate``/``stream`` prefill the whole prompt as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from osd.decode.generation import TokenLogprob

__all__ = ["PendingLogprobs", "PromptLogprobs", "gather_logprobs"]


@dataclass
class PendingLogprobs:
    """Log probabilities on their way to the host (readable after the step's sync).

    Attributes:
        members: batch indices of the rows that asked, in order.
        token_logprobs: (W, T) each position's emitted token's logprob.
        top_ids, top_logprobs: (W, T, n) the n most likely tokens per position (n: the largest
            number any member asked for; each row keeps its own first few).
    """

    members: list[int]
    num_top: list[int]
    token_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    _rows: dict[int, list[TokenLogprob]] | None = field(default=None, init=False, repr=False)

    def rows(self) -> dict[int, list[TokenLogprob]]:
        """Per member's batch index, one entry per position (call after the host sync)."""
        if self._rows is None:
            self._rows = self._read()
        return self._rows

    def _read(self) -> dict[int, list[TokenLogprob]]:
        lps, ids, tops = (
            self.token_logprobs.tolist(),
            self.top_ids.tolist(),
            self.top_logprobs.tolist(),
        )
        out: dict[int, list[TokenLogprob]] = {}
        for w, b in enumerate(self.members):
            n = self.num_top[w]
            out[b] = [
                TokenLogprob(lp, list(zip(ids[w][t][:n], tops[w][t][:n], strict=True)))
                for t, lp in enumerate(lps[w])
            ]
        return out


def gather_logprobs(
    logits: torch.Tensor,
    logits_row: torch.Tensor,
    token_ids: torch.Tensor,
    members: list[int],
    num_top: list[int],
) -> PendingLogprobs:
    """Starts computing and copying the logprobs of ``members``' tokens.

    Args:
        logits: (R, T, V) the target's logits; position i after a row's i-th emitted token.
        logits_row: (B,) each batch row's row of ``logits``.
        token_ids: (B, T) the tokens emitted at each position (past a row's last one: any).
        members: batch indices of the rows that asked for logprobs.
        num_top: alternatives each member asked for (0..20).

    Returns:
        The pending result; its tensors are on the host once the step's sync returns.
    """
    index = torch.tensor(members, device=logits.device)
    logprobs = torch.log_softmax(logits[logits_row[index]].float(), dim=-1)  # (W, T, V)
    chosen = logprobs.gather(-1, token_ids[index].unsqueeze(-1))[..., 0]  # (W, T)
    top_logprobs, top_ids = logprobs.topk(
        min(max(num_top), logprobs.shape[-1]), dim=-1
    )  # (W, T, n)
    # non_blocking into pinned memory: done by the time the step's one sync returns.
    return PendingLogprobs(
        members,
        num_top,
        *(t.to("cpu", non_blocking=True) for t in (chosen, top_ids, top_logprobs)),
    )


@dataclass
class PromptLogprobs:
    """One row's prompt logprobs, gathered chunk by chunk during its prefill.

    Attributes:
        parts: per prefill chunk, its pending logprobs, the row's batch index in them and the
            positions kept (those whose next token is a prompt token).
        entries: the whole list once :meth:`resolve` read it: None for the first prompt
            token, then one entry per later prompt token.
    """

    parts: list[tuple[PendingLogprobs, int, slice]] = field(default_factory=list)
    entries: list[TokenLogprob | None] | None = None

    def resolve(self) -> list[TokenLogprob | None]:
        """The entries (call after the sync that ends the row's prefill)."""
        if self.entries is None:
            self.entries = [None]
            for pending, b, kept in self.parts:
                self.entries += pending.rows()[b][kept]
            self.parts = []
        return self.entries
