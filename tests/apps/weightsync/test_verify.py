"""What a rollout proves: checksums naming the first differing tensor, and the decode comparison."""

import torch

from hal.apps.weightsync.messages import Reference
from hal.apps.weightsync.verify import checksums, compare_decode, first_mismatch, verify


def test_checksums_are_crc32_of_the_bytes_and_a_mismatch_names_the_first_tensor():
    sums = checksums([("a", torch.zeros(2, dtype=torch.uint8)), ("b", torch.tensor([1.0]))])
    assert sums == {"a": "41d912ff", "b": "aca16a6a"}
    assert first_mismatch(sums, dict(sums)) is None
    assert first_mismatch(sums, {"a": "41d912ff", "b": "00000000"}) == \
        "tensor 'b': checksum 00000000 differs from the trainer's aca16a6a"
    assert first_mismatch(sums, {"b": sums["b"]}) == "tensor 'a' was not received"
    assert first_mismatch(sums, {**sums, "c": "1"}) == "tensor 'c' was received but not sent"


def test_verify_names_the_step_served_before_any_tensor():
    class Served:
        served_step = 2

        def state_dict(self):
            return {"w": torch.ones(1)}

    assert verify(Served(), 3, {"w": "x"}) == "rollout serves step 2, expected 3"
    assert verify(Served(), 2, checksums([("w", torch.ones(1))])) is None


def test_decode_compare_names_tokens_then_logits_over_the_tolerance():
    ref = Reference({}, [5, 6], torch.zeros(2, 3))
    assert compare_decode([5, 6], torch.full((2, 3), 0.25), ref, 0.25) == (True, 0.25, None)
    equal, diff, error = compare_decode([5, 6], torch.full((2, 3), 0.5), ref, 0.25)
    assert (equal, diff, error) == (True, 0.5, "decode logits differ from the trainer's by 0.5 (> --logits-atol 0.25)")
    assert compare_decode([5, 7], torch.zeros(2, 3), ref, 0.01)[2] == \
        "greedy decode gave tokens [5, 7], the trainer's model [5, 6]"


def test_a_sharded_trainers_checksums_name_row_ranges_and_a_rollout_checks_those_rows():
    from ckpt import RowShard

    from hal.apps.weightsync.verify import served_checksums

    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    rank0 = checksums([("w", RowShard(full[:2], 0, (4, 3))), ("b", torch.ones(3))])
    rank1 = checksums([("w", RowShard(full[2:], 2, (4, 3)))])
    expected = {**rank0, **rank1}
    assert list(expected) == ["w[0:2]", "b", "w[2:4]"]
    assert expected["w[2:4]"] == checksums([("x", full[2:])])["x"]  # the rows' own bytes
    served = {"w": full.clone(), "b": torch.ones(3)}
    assert first_mismatch(expected, served_checksums(expected, served)) is None
    served["w"][3, 1] = -1.0  # one value in rank 1's rows
    assert first_mismatch(expected, served_checksums(expected, served)).startswith("tensor 'w[2:4]': checksum ")
    del served["b"]
    assert first_mismatch(expected, served_checksums(expected, served)) == "tensor 'b' was not received"
    served = {"w": full.clone(), "b": torch.ones(3), "c": torch.zeros(1)}
    assert first_mismatch(expected, served_checksums(expected, served)) == "tensor 'c' was received but not sent"
