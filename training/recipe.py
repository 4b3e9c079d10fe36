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

from .attention import Blockwise, Flex, choose, dense_mask
from .examples import Example

RECIPES = ("naive", "pad", "full")
IGNORE = -100


@dataclass(slots=True)
class Batch:
    """Model inputs plus targets; logits are computed only at logits_idx."""

    ids: Tensor  # [B, (V+1) L]
    pos: Tensor  # [B, (V+1) L]
    visible: Tensor  # [B] real (+pad) length of each row; the attention rule hides keys past it
    logits_idx: Tensor  # [B, n] index into the row: view * L + (i - 1)
    targets: Tensor  # [B, n] token at i, IGNORE where the slot is padding
    views: int
    length: int  # L
    block_size: int
    seq_tokens: int  # real prompt + answer tokens (what "tokens seen" counts)
    answer_tokens: int
    loss_tokens: int

    @property
    def mask(self) -> Tensor:
        """[B, 1, (V+1) L, (V+1) L] bool, True = may attend (the dense form of the rule)."""
        return dense_mask(self.length, self.visible, self.views, self.block_size)

    @property
    def block_aligned(self) -> bool:
        """Every block wholly real or wholly padding: what the blockwise attention needs."""
        return bool((self.visible % self.block_size == 0).all())

    def attention(self, impl: str) -> Tensor | Blockwise | Flex:
        """What the model's `mask=` takes for this batch: the dense mask or a block-sparse attention."""
        impl = choose(impl, self.ids.device, self.block_aligned)
        if impl == "blockwise":
            return Blockwise(self.length, self.views, self.block_size)
        if impl == "flex":
            return Flex(self.length, self.views, self.block_size, self.visible)
        return self.mask

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.ids.to(device), self.pos.to(device), self.visible.to(device), self.logits_idx.to(device),
                     self.targets.to(device), self.views, self.length, self.block_size, self.seq_tokens,
                     self.answer_tokens, self.loss_tokens)


def padded_len(n: int, block_size: int, pad: bool) -> int:
    """Visible length of a sequence: up to the next block boundary when padding with mask tokens."""
    return -(-n // block_size) * block_size if pad else n


def draw_noise(ex: Example, block_size: int, gen: torch.Generator, *, later: float = 0.0,
               sub_block_size: int = 8) -> Tensor:
    """Per block t ~ U(0,1); each answer token is masked with probability t (prompt tokens never).

    later = λ in [0, 1] tilts the rate inside each sub-block into a ramp t * (1 + λ (2j/(s-1) - 1)) over
    its positions j, clamped to [0, 1] (mean t until the clamp bites: at λ = 1 the overall rate is 0.44
    instead of 0.5): later positions are masked more often, as they stay masked longer while
    left-to-right sub-block decoding runs. λ = 0 is the paper's noise, draw for draw.
    """
    if not 0.0 <= later <= 1.0:
        raise ValueError(f"later (mask-later bias) must be in [0, 1] (got {later})")
    n = len(ex.ids)
    blocks = -(-n // block_size)
    t = torch.rand(blocks, generator=gen)
    u = torch.rand(n, generator=gen)
    rate = t.repeat_interleave(block_size)[:n]
    if later:
        if sub_block_size < 2 or block_size % sub_block_size:
            raise ValueError(f"sub_block_size must be >= 2 and divide block_size {block_size} (got {sub_block_size})")
        j = (torch.arange(n) % block_size % sub_block_size).float()
        rate = (rate * (1 + later * (2 * j / (sub_block_size - 1) - 1))).clamp(0, 1)
    masked = u < rate
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
    return dense_mask(length, torch.tensor([visible]), views, block_size)[0, 0]


def build_batch(examples: list[Example], noise: list[Tensor], *, recipe: str, block_size: int, mask_id: int,
                pad_id: int) -> Batch:
    """Assemble one batch from examples and their drawn noise (draw_noise), per the recipe."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES} (got {recipe!r})")
    pad, complementary = recipe != "naive", recipe == "full"
    nviews = 2 if complementary else 1
    vis = [padded_len(len(ex.ids), block_size, pad) for ex in examples]
    length = -(-max(vis) // block_size) * block_size
    rows_ids, rows_idx, rows_tgt = [], [], []
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
        rows_idx.append(torch.cat(idx))
        rows_tgt.append(torch.cat(tgt))
    width = max(1, max(len(i) for i in rows_idx))
    logits_idx = torch.stack([F.pad(i, (0, width - len(i))) for i in rows_idx])
    targets = torch.stack([F.pad(t, (0, width - len(t)), value=IGNORE) for t in rows_tgt])
    ids = torch.stack(rows_ids)
    pos = torch.arange(length).repeat(nviews + 1)[None].expand(len(examples), -1).contiguous()
    return Batch(ids, pos, torch.tensor(vis), logits_idx, targets, nviews, length, block_size,
                 seq_tokens=sum(len(ex.ids) for ex in examples), answer_tokens=sum(ex.answer_len for ex in examples),
                 loss_tokens=int((targets != IGNORE).sum()))


@dataclass(frozen=True, slots=True)
class LossConfig:
    """Certainty forcing (dParallel): + weight x the entropy of softmax(logits / temperature) where the
    model's argmax already equals the target, which pushes correct predictions to be confident ones
    (what a threshold decoder needs to commit several tokens per forward). weight 0: the paper's loss."""

    certainty_weight: float = 0.0
    certainty_temperature: float = 0.5
    # + kl_weight x KL(base || dLLM): at every masked answer position, the AR base's next-token distribution (the same
    # weights with the adapter off, causal, on the clean sequence) against the dLLM's there (DESIGN.md section 5: the
    # base's whole distribution as the target, not only its greedy token). 0: off.
    kl_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.certainty_weight < 0:
            raise ValueError(f"certainty_weight must be >= 0 (got {self.certainty_weight})")
        if self.kl_weight < 0:
            raise ValueError(f"kl_weight (--distill-kl) must be >= 0 (got {self.kl_weight})")
        if self.certainty_temperature <= 0:
            raise ValueError(f"certainty_temperature must be > 0 (got {self.certainty_temperature})")


def teacher_logits(model, batch: Batch) -> Tensor:
    """[B, n, V] the AR base's logits for the batch's targets: the clean copy (the row's last segment), causal, the
    adapter off, no gradient; position i - 1 of the clean copy predicts target i (logits_idx modulo the length)."""
    from .lora import adapter_off

    clean = slice(batch.views * batch.length, (batch.views + 1) * batch.length)
    with torch.no_grad(), adapter_off(model):
        return model(batch.ids[:, clean], batch.pos[:, clean], causal=True, logits_idx=batch.logits_idx % batch.length)


def loss_parts(model, batch: Batch, attention: str = "auto", loss: LossConfig = LossConfig()) -> dict[str, Tensor]:
    """{"loss", "ce"[, "kl"][, "entropy", "correct"]}: mean cross-entropy over the masked answer tokens (token shift
    via logits_idx) plus, when asked, the mean KL from the base's distribution there and the certainty-forcing term
    over the correctly predicted ones."""
    logits = model(batch.ids, batch.pos, mask=batch.attention(attention), logits_idx=batch.logits_idx)
    logits = logits.float().flatten(0, 1)
    targets = batch.targets.flatten()
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum") / max(batch.loss_tokens, 1)
    out = {"loss": ce, "ce": ce}
    keep = targets != IGNORE
    if loss.kl_weight:
        teacher = F.log_softmax(teacher_logits(model, batch).float().flatten(0, 1)[keep], dim=-1)
        kl = F.kl_div(F.log_softmax(logits[keep], dim=-1), teacher, log_target=True, reduction="sum") \
            / max(batch.loss_tokens, 1)
        out.update(loss=out["loss"] + loss.kl_weight * kl, kl=kl)
    if not loss.certainty_weight:
        return out
    logits, targets = logits[keep], targets[keep]
    correct = logits.argmax(-1) == targets
    logp = F.log_softmax(logits[correct] / loss.certainty_temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1).sum() / correct.sum().clamp(min=1)
    out.update(loss=out["loss"] + loss.certainty_weight * entropy, entropy=entropy, correct=correct.float().mean())
    return out


def batch_loss(model, batch: Batch, attention: str = "auto", loss: LossConfig = LossConfig()) -> Tensor:
    """The training loss of one batch (see loss_parts)."""
    return loss_parts(model, batch, attention, loss)["loss"]
