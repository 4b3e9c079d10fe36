"""The Fast-dLLM v2 training recipe: block noise, complementary views, [noisy || clean] input, mask, loss.

One batch row per sequence holds V noisy views and one clean copy, each L tokens at the same
positions: [noisy_1 || ... || noisy_V || clean]. V = 2 (the mask m and its complement) for the full
recipe: both views share one clean copy, which gives exactly the logits of two [noisy || clean] rows
(a noisy view sees only itself and the clean copy) at 3L instead of 4L tokens.

Recipes (the paper's ablation): "naive" = token shift on block-noised answers, no padding, one view;
"pad" = + answers padded with mask tokens to a block boundary; "full" = + the complementary view.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .data import Example

RECIPES = ("naive", "pad", "full")
IGNORE = -100


@dataclass(slots=True)
class Batch:
    """Model inputs plus targets; logits are computed only at logits_idx."""

    ids: Tensor  # [B, (V+1) L]
    pos: Tensor  # [B, (V+1) L]
    mask: Tensor  # [B, 1, (V+1) L, (V+1) L] bool, True = may attend
    logits_idx: Tensor  # [B, n] index into the row: view * L + (i - 1)
    targets: Tensor  # [B, n] token at i, IGNORE where the slot is padding
    views: int
    length: int  # L
    seq_tokens: int  # real prompt + answer tokens (what "tokens seen" counts)
    loss_tokens: int


def padded_len(n: int, block_size: int, pad: bool) -> int:
    """Visible length of a sequence: up to the next block boundary when padding with mask tokens."""
    return -(-n // block_size) * block_size if pad else n


def draw_noise(ex: Example, block_size: int, gen: torch.Generator) -> Tensor:
    """Per block t ~ U(0,1); each answer token is masked with probability t (prompt tokens never)."""
    n = len(ex.ids)
    blocks = -(-n // block_size)
    t = torch.rand(blocks, generator=gen)
    u = torch.rand(n, generator=gen)
    masked = u < t.repeat_interleave(block_size)[:n]
    masked[:ex.prompt_len] = False
    return masked


def views_for(ex: Example, masked: Tensor, complementary: bool) -> list[Tensor]:
    """The noisy view m and, for the full recipe, its complement over the answer tokens."""
    if not complementary:
        return [masked]
    answer = torch.zeros_like(masked)
    answer[ex.prompt_len:] = True
    return [masked, answer & ~masked]


def attention_mask(length: int, visible: int, views: int, block_size: int) -> Tensor:
    """[(V+1)L, (V+1)L] visibility for one row (the recipe's rule, segment V being the clean copy).

    Same segment and same block: allowed. Noisy query, clean key of a strictly earlier block: allowed.
    Clean query, clean key of the same or an earlier block: allowed. Nothing else. Keys at positions
    >= visible (batch padding) are hidden; a padding query sees only itself (no empty softmax rows).
    """
    idx = torch.arange((views + 1) * length)
    seg, p = idx // length, idx % length
    blk = p // block_size
    sq, sk = seg[:, None], seg[None, :]
    bq, bk = blk[:, None], blk[None, :]
    clean = views
    allowed = (sq == sk) & (bq == bk)
    allowed |= (sq != clean) & (sk == clean) & (bk < bq)
    allowed |= (sq == clean) & (sk == clean) & (bk <= bq)
    allowed &= (p < visible)[None, :]
    allowed |= torch.eye(len(idx), dtype=torch.bool) & (p >= visible)[:, None]
    return allowed


def build_batch(examples: list[Example], noise: list[Tensor], *, recipe: str, block_size: int, mask_id: int,
                pad_id: int) -> Batch:
    """Assemble one batch from examples and their drawn noise (draw_noise), per the recipe."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES} (got {recipe!r})")
    pad, complementary = recipe != "naive", recipe == "full"
    nviews = 2 if complementary else 1
    vis = [padded_len(len(ex.ids), block_size, pad) for ex in examples]
    length = -(-max(vis) // block_size) * block_size
    rows_ids, rows_mask, rows_idx, rows_tgt = [], [], [], []
    for ex, m, visible in zip(examples, noise, vis):
        n = len(ex.ids)
        clean = torch.full((length,), pad_id, dtype=torch.long)
        clean[:n] = torch.tensor(ex.ids, dtype=torch.long)
        clean[n:visible] = mask_id  # "+pad": mask tokens up to the block boundary (no loss there)
        segs, idx, tgt = [], [], []
        for v, vm in enumerate(views_for(ex, m, complementary)):
            noisy = clean.clone()
            noisy[:n][vm] = mask_id
            segs.append(noisy)
            where = vm.nonzero().flatten()  # masked answer positions i (i >= prompt_len >= 1)
            idx.append(v * length + where - 1)  # token shift: logits at i - 1 predict token i
            tgt.append(clean[where])
        rows_ids.append(torch.cat(segs + [clean]))
        rows_mask.append(attention_mask(length, visible, nviews, block_size))
        rows_idx.append(torch.cat(idx))
        rows_tgt.append(torch.cat(tgt))
    width = max(1, max(len(i) for i in rows_idx))
    logits_idx = torch.stack([F.pad(i, (0, width - len(i))) for i in rows_idx])
    targets = torch.stack([F.pad(t, (0, width - len(t)), value=IGNORE) for t in rows_tgt])
    ids = torch.stack(rows_ids)
    pos = torch.arange(length).repeat(nviews + 1)[None].expand(len(examples), -1).contiguous()
    return Batch(ids, pos, torch.stack(rows_mask)[:, None], logits_idx, targets, nviews, length,
                 seq_tokens=sum(len(ex.ids) for ex in examples), loss_tokens=int((targets != IGNORE).sum()))


def batch_loss(model, batch: Batch) -> Tensor:
    """Mean cross-entropy over the masked answer tokens of the batch (token shift via logits_idx)."""
    logits = model(batch.ids, batch.pos, mask=batch.mask, logits_idx=batch.logits_idx)
    return F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE,
                           reduction="sum") / max(batch.loss_tokens, 1)
