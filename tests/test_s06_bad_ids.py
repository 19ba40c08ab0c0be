"""S06 token ids that are not integers in [0, V) (issue 12): `TorchTransformer.forward` /
`check_ids`, `CachedTransformer.prefill` and `decode` raise ValueError naming the rule, with
S03's messages for sequences (S03's check, `s01.is_int` per Python value), instead of
truncating 2.7 to 2, reading True or '7' as ids, or raising TypeError for None.

Oracle: the rule as S03 states it (1.5 or True is never truncated to an id), and for the ids
that stay allowed (NumPy integers, 0-d integer arrays and tensors, integer arrays and tensors)
the logits of the same ids as plain Python ints.
"""
import numpy as np
import pytest
import torch

from model_testing import V, build_tiny
from s06_torch import CachedTransformer, TorchTransformer

NOT_INTEGERS = "token ids must be integers"
NOT_A_SEQUENCE = "forward needs a non-empty 1-D sequence of token ids"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_gqa_tied")
    build_tiny("qwen3_gqa_tied", directory)
    return TorchTransformer.from_pretrained(directory)


BAD_SEQUENCES = [
    ([1, 2.7], NOT_INTEGERS),              # used to run as [1, 2]
    ([2.0], NOT_INTEGERS),                 # a float is not an id, even a whole one
    ([1, True], NOT_INTEGERS),             # used to run as [1, 1]
    ([np.bool_(True)], NOT_INTEGERS),
    (["7"], NOT_INTEGERS),                 # used to run as [7]
    ([None], NOT_INTEGERS),                # used to be a TypeError
    ([np.float64(3.0)], NOT_INTEGERS),
    ([np.array(2.7)], NOT_INTEGERS),       # a 0-d array is judged by its value
    ([torch.tensor(2.7)], NOT_INTEGERS),
    ([torch.tensor(True)], NOT_INTEGERS),
    (np.array([1.5, 2.0]), NOT_INTEGERS),  # an array by its dtype
    (np.array([True]), NOT_INTEGERS),
    (np.array(["7"]), NOT_INTEGERS),
    (torch.tensor([1.5]), NOT_INTEGERS),
    (torch.tensor([True, False]), NOT_INTEGERS),
    (None, NOT_A_SEQUENCE),                # used to be a TypeError
    (5, NOT_A_SEQUENCE),
    ("7", NOT_A_SEQUENCE),
    ([], NOT_A_SEQUENCE),
    ([[1, 2]], NOT_A_SEQUENCE),
    ([1, V], rf"token ids must lie in \[0, {V}\)"),
    ([-1], rf"token ids must lie in \[0, {V}\)"),
    ([2**63], rf"token ids must lie in \[0, {V}\)"),
]
BAD_IDS = [repr(ids)[:40] for ids, _ in BAD_SEQUENCES]


@pytest.mark.parametrize("token_ids, message", BAD_SEQUENCES, ids=BAD_IDS)
def test_forward_rejects_ids_that_are_not_integers_in_range(model, token_ids, message):
    with pytest.raises(ValueError, match=message):
        model.forward(token_ids)


@pytest.mark.parametrize("token_ids, message", BAD_SEQUENCES, ids=BAD_IDS)
def test_prefill_rejects_them_too_and_leaves_the_cache_alone(model, token_ids, message):
    runner = CachedTransformer(model, max_seq_len=8)
    runner.prefill([3, 5])
    with pytest.raises(ValueError, match=message):
        runner.prefill(token_ids)
    assert runner.cache.num_cached == 2


@pytest.mark.parametrize("token", [2.7, 3.0, True, np.bool_(False), "7", None, np.float32(1),
                                   V, -1], ids=repr)
def test_decode_rejects_a_host_id_that_is_not_an_integer_in_range(model, token):
    runner = CachedTransformer(model, max_seq_len=8)
    runner.prefill([3, 5])
    with pytest.raises(ValueError, match=rf"token id must be an integer in \[0, V={V}\)"):
        runner.decode(token)
    assert runner.cache.num_cached == 2


@pytest.mark.parametrize("token_ids", [
    [np.int64(3), np.int32(5)], (3, 5), [np.array(3), torch.tensor(5)],
    np.array([3, 5]), np.array([3, 5], dtype=np.uint8), torch.tensor([3, 5]),
    torch.tensor([3, 5], dtype=torch.int32),
], ids=repr)
def test_integers_in_other_types_stay_allowed(model, token_ids):
    np.testing.assert_array_equal(model.forward(token_ids), model.forward([3, 5]))
    runner = CachedTransformer(model, max_seq_len=8)
    expected = runner.prefill([3, 5]).numpy()
    np.testing.assert_array_equal(runner.prefill(token_ids).numpy(), expected)


def test_forward_takes_a_range_and_decode_a_numpy_integer(model):
    np.testing.assert_array_equal(model.forward(range(3)), model.forward([0, 1, 2]))
    runner = CachedTransformer(model, max_seq_len=8)
    runner.prefill([3])
    with_numpy = runner.decode(np.uint8(5)).numpy()
    runner.prefill([3])
    np.testing.assert_array_equal(with_numpy, runner.decode(5).numpy())
