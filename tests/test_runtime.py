import numpy as np
import pytest

from aqua_export.config import ConfigError
from aqua_export.runtime.folder import FolderConfig
from aqua_export.runtime.sampling import SamplingConfig, pick


def test_greedy_picks_lowest_id_on_ties():
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 5.0]])
    assert pick(logits, SamplingConfig(), None).tolist() == [1, 0]


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    rng = lambda: np.random.default_rng(7)  # noqa: E731
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 64))
    a = pick(logits, SamplingConfig(do_sample=True, seed=7), rng())
    b = pick(logits, SamplingConfig(do_sample=True, seed=7), rng())
    assert np.array_equal(a, b) and len(set(a.tolist())) > 1
    assert set(pick(logits, SamplingConfig(do_sample=True, top_k=2), rng()).tolist()) <= {0, 1}
    # top_p 0.6: 0.5 alone is not enough, 0.5 + 0.3 is -> tokens {0, 1}
    assert set(pick(logits, SamplingConfig(do_sample=True, top_p=0.6), rng()).tolist()) <= {0, 1}
    assert set(pick(logits, SamplingConfig(do_sample=True, top_p=0.4), rng()).tolist()) == {0}


@pytest.mark.parametrize("kw,needle", [({"temperature": 0}, "temperature"), ({"top_p": 0}, "top-p"),
                                       ({"max_new_tokens": -1}, "max-new-tokens")])
def test_bad_sampling_settings(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        SamplingConfig(**kw)


def test_not_a_built_folder(tmp_path):
    with pytest.raises(ConfigError, match="is not an aqua-export folder"):
        FolderConfig.from_folder(tmp_path)
    (tmp_path / "aqua_config.json").write_text("{")
    with pytest.raises(ConfigError, match="corrupt"):
        FolderConfig.from_folder(tmp_path)


