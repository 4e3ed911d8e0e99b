"""The folder tokenizer (runtime.tokenizer: tokenizers + jinja2, no transformers) against transformers' AutoTokenizer
on the embedded model: the same ids, masks, chat prompts, decoded text and special tokens."""

import pytest
from transformers import AutoTokenizer

from aqua_export import models
from aqua_export.config import ConfigError
from aqua_export.runtime.text import encode_prompts, load_tokenizer

PROMPTS = ["Hello there", "Ünïcödé 🚀 text, with punctuation . ? and 你好", "x" * 50 + " def f():\n    return 1", " "]


@pytest.fixture(scope="module")
def both():
    folder = models.resolve("llama")[0]
    hf = AutoTokenizer.from_pretrained(folder)
    if hf.pad_token is None:
        hf.pad_token = hf.eos_token
    return hf, load_tokenizer(folder)


@pytest.mark.parametrize("chat", [False, True])
def test_prompts_encode_as_transformers_does(both, chat):
    hf, ours = both
    ids, mask = encode_prompts(ours, PROMPTS, chat=chat)
    want_ids, want_mask = encode_prompts(hf, PROMPTS, chat=chat)
    assert (ids == want_ids).all() and (mask == want_mask).all()
    for row in ids:
        for skip in (False, True):
            assert ours.decode(row, skip_special_tokens=skip) == hf.decode(row, skip_special_tokens=skip)


def test_special_tokens_and_plain_calls(both):
    hf, ours = both
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id, len(ours)) == \
        (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id, len(hf))
    for p in PROMPTS:
        assert ours(p, add_special_tokens=False)["input_ids"] == hf(p, add_special_tokens=False)["input_ids"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == \
        hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_a_damaged_tokenizer_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be loaded.*rebuild the folder"):
        load_tokenizer(tmp_path)
