"""The model: KV-cache decoding matches a full forward; batching does not change results."""

from __future__ import annotations

import torch

from gpuscope.server.config import ModelSpec
from gpuscope.server.model import BOS, StreamDecoder, build_model, encode

SPEC = ModelSpec(layers=2, dim=64, heads=4, context=64, seed=3)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    model.allocate_cache(1)
    t = torch.tensor([ids])
    zero = torch.zeros(1, dtype=torch.long)
    return model(t, zero, zero, torch.tensor([len(ids) - 1]), len(ids))[0]


@torch.inference_mode()
def test_incremental_decode_matches_full_forward():
    model = build_model(SPEC)
    ids = encode("kv cache check")
    model.allocate_cache(2)
    slot = torch.tensor([1])
    model(torch.tensor([ids[:5]]), slot, torch.tensor([0]), torch.tensor([4]), 5)
    for pos in range(5, len(ids)):
        step = model(torch.tensor([[ids[pos]]]), slot, torch.tensor([pos]), torch.tensor([0]), pos + 1)[0]
        expected = full_logits(model, ids[: pos + 1])
        model.allocate_cache(2)  # full_logits reallocated the cache: rebuild slot 1's prefix
        model(torch.tensor([ids[: pos + 1]]), slot, torch.tensor([0]), torch.tensor([pos]), pos + 1)
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_padded_batch_prefill_and_mixed_position_decode_match_single_rows():
    model = build_model(SPEC)
    a, b = encode("short"), encode("a longer prompt")
    singles = [full_logits(model, a), full_logits(model, b)]
    model.allocate_cache(2)
    tokens = torch.zeros((2, len(b)), dtype=torch.long)
    tokens[0, : len(a)] = torch.tensor(a)
    tokens[1] = torch.tensor(b)
    last = torch.tensor([len(a) - 1, len(b) - 1])
    out = model(tokens, torch.tensor([0, 1]), torch.tensor([0, 0]), last, len(b))
    torch.testing.assert_close(out, torch.stack(singles), rtol=1e-4, atol=1e-4)
    # One decode step with the two rows at different positions.
    nxt = torch.tensor([[65], [66]])
    step = model(nxt, torch.tensor([0, 1]), torch.tensor([len(a), len(b)]), torch.tensor([0, 0]), len(b) + 1)
    torch.testing.assert_close(step[0], full_logits(model, [*a, 65]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[1], full_logits(model, [*b, 66]), rtol=1e-4, atol=1e-4)


def test_seed_fixes_weights_and_checkpoint_loads(tmp_path):
    one, two = build_model(SPEC), build_model(SPEC)
    assert all(torch.equal(p, q) for p, q in zip(one.parameters(), two.parameters(), strict=True))
    other = build_model(ModelSpec(layers=2, dim=64, heads=4, context=64, seed=4))
    assert not torch.equal(one.lm_head.weight, other.lm_head.weight)
    path = tmp_path / "ckpt.pt"
    torch.save(other.state_dict(), path)
    loaded = build_model(ModelSpec(layers=2, dim=64, heads=4, context=64, seed=3, checkpoint=str(path)))
    assert torch.equal(loaded.lm_head.weight, other.lm_head.weight)


def test_tokenizer_round_trips_utf8_split_across_tokens():
    ids = encode("héllo ✓")
    assert ids[0] == BOS and len(ids) == 1 + len("héllo ✓".encode())
    decoder = StreamDecoder()
    pieces = [decoder.feed(t) for t in ids]
    assert "".join(pieces) + decoder.finish() == "héllo ✓"
    assert "" in pieces[2:]  # the first byte of a multi-byte character waits for the rest
