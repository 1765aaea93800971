"""The vLLM rollout role's test hook, read without vLLM: which steps a rollout refuses
(``HAL_TEST_VLLM_REFUSE_STEPS``), kept out of the job's options. The role itself runs in ``tests/vllm``."""

import re

import pytest

from hal.apps.weightsync.options import JobOptions
from hal.apps.weightsync.vllm_role import REFUSE_STEPS_ENV, refuse_steps


def test_the_steps_to_refuse_come_from_the_environment_not_the_jobs_options(monkeypatch):
    monkeypatch.delenv(REFUSE_STEPS_ENV, raising=False)
    assert refuse_steps() == frozenset()
    monkeypatch.setenv(REFUSE_STEPS_ENV, " 2, 5 ")
    assert refuse_steps() == {2, 5}
    assert not any("fail" in name or "refuse" in name for name in JobOptions.__dataclass_fields__)


@pytest.mark.parametrize("text", ["two", "2;5", "-1", "2,,5", "2_0", "+3"])
def test_a_bad_list_of_steps_is_refused_naming_it(monkeypatch, text):
    monkeypatch.setenv(REFUSE_STEPS_ENV, text)
    with pytest.raises(ValueError, match=re.escape(f"{REFUSE_STEPS_ENV}={text!r}: expected comma-separated global_steps")):
        refuse_steps()
