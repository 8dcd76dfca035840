"""The weight-sync fingerprint: a function of the bytes alone, and no flipped bit goes unseen."""

from __future__ import annotations

import torch

from dockyard.weights.fingerprint import ROW_BYTES, Fingerprint, fingerprint


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_every_single_flipped_bit_changes_the_fingerprint() -> None:
    # Two full rows and a 13-byte tail: every part of the computation gets flips.
    data = _bytes(2 * ROW_BYTES + 13)
    reference = fingerprint(data)
    for position in range(data.numel()):
        for bit in (0, 7) if position % 5 else range(8):
            flipped = data.clone()
            flipped[position] ^= 1 << bit
            assert fingerprint(flipped) != reference, (position, bit)


def test_the_top_bit_of_a_word_is_caught() -> None:
    words = torch.randint(-(2**62), 2**62, (ROW_BYTES // 8 * 3,), generator=torch.Generator().manual_seed(1))
    flipped = words.clone()
    flipped[70] ^= -(2**63)  # bit 63
    assert fingerprint(flipped) != fingerprint(words)


def test_equal_bytes_give_equal_fingerprints_across_dtypes_and_alignment() -> None:
    data = _bytes(4 * ROW_BYTES + 40, seed=2)
    as_float = data.view(torch.float32)
    as_bf16 = data.view(torch.bfloat16).view(-1, 4)
    as_int64 = data.view(torch.int64)
    expected = fingerprint(data)
    assert fingerprint(as_float) == fingerprint(as_bf16) == fingerprint(as_int64) == expected
    # The same bytes at an address that is no multiple of 8.
    shifted = torch.empty(data.numel() + 3, dtype=torch.uint8)
    shifted[3:] = data
    assert fingerprint(shifted[3:]) == expected


def test_moved_rows_and_words_change_it_and_order_of_buffers_counts() -> None:
    data = _bytes(4 * ROW_BYTES, seed=3)
    rows = data.view(4, ROW_BYTES)
    swapped_rows = rows[[1, 0, 2, 3]].reshape(-1)
    words = data.view(torch.int64).view(4, -1)
    swapped_words = words[:, [1, 0, *range(2, words.shape[1])]].reshape(-1)
    assert len({fingerprint(data), fingerprint(swapped_rows), fingerprint(swapped_words)}) == 3
    a, b = _bytes(100, seed=4), _bytes(100, seed=5)
    assert fingerprint(a, b) != fingerprint(b, a)
    f = Fingerprint()
    f.update(a)
    f.update(b)
    assert f.hexdigest() == fingerprint(a, b) and len(f.hexdigest()) == 64
