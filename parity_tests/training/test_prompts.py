"""``training.prompts``: the ids a prompt becomes (what the template puts before a text, never what it puts
after) and what a folder's tokenizer files decide (``tokenizer_config.json``'s ``add_bos_token``, the stop ids of
``generation_config.json`` before ``config.json``'s).

The tokenizers are tiny word-level ones built here with the ``tokenizers`` library (no training); the references
are that library's own encoding (with its special tokens) and transformers' ``GenerationConfig``. The model-level
scenarios (``continue_folder``'s token budget and stop) are in ``parity_tests/cli/test_folder_generation.py``.
"""

import json

import pytest

from flax_transformer.training import prompts

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, ",": 5, "again": 6, "<|eot|>": 7}


def _tokenizer(single: str):
    """A word-level tokenizer whose template for a single text is ``single`` (``<s>`` 1, ``</s>`` 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 1), ("</s>", 2)])
    return tokenizer


def _folder(path, single: str, **files) -> object:
    """``path`` holding tokenizer.json (template ``single``) and the JSON files named in ``files``."""
    path.mkdir()
    _tokenizer(single).save(str(path / "tokenizer.json"))
    for name, content in files.items():
        (path / f"{name}.json").write_text(json.dumps(content))
    return path


def test_a_template_with_an_eos_gives_its_bos_only():
    """Llama's ``<s> $A </s>`` template (add_eos_token): the prompt is the BOS and the text; the EOS after it
    would end the text before its continuation."""
    tokenizer = _tokenizer("<s> $A </s>")
    assert prompts.template_prefix(tokenizer) == [1]
    for text in ["hello world , again", ""]:
        full = tokenizer.encode(text).ids  # the template's own: <s> text </s>
        assert full[0] == 1 and full[-1] == 2
        assert prompts.prompt_ids(tokenizer, text).tolist() == full[:-1]


def test_add_bos_token_false_drops_the_templates_bos(tmp_path):
    """tokenizer_config.json's add_bos_token: false over a ``<s> $A`` template: no BOS before a prompt, in the
    folder's prefix and the ids generate continues; an empty prompt then has no ids and is refused."""
    settings = {"add_bos_token": False, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    folder = _folder(tmp_path / "nobos", "<s> $A", tokenizer_config=settings)
    tokens = prompts.folder_tokenizer(folder)
    assert tokens.prefix == ()
    text = "hello world"
    with_bos = tokens.tokenizer.encode(text).ids  # the template's own
    assert with_bos[0] == 1
    assert prompts.prompt_ids(tokens.tokenizer, text, prefix=tokens.prefix).tolist() == with_bos[1:]
    with pytest.raises(prompts.PromptError, match="gives no tokens"):
        prompts.prompt_ids(tokens.tokenizer, "", prefix=tokens.prefix)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"add_bos_token": True}))
    assert prompts.folder_tokenizer(folder).prefix == (1,)


def test_generation_configs_stops_come_before_config_jsons(tmp_path):
    """Llama 3 Instruct: config.json's eos_token_id is one id, generation_config.json's a list; generate stops
    at the list's, as transformers' GenerationConfig reads it."""
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path / "instruct", "<s> $A", config={"eos_token_id": 2},
                     generation_config={"eos_token_id": [2, 7, 5]})
    want = transformers.GenerationConfig.from_pretrained(folder).eos_token_id
    assert want == [2, 7, 5] and prompts.folder_tokenizer(folder).eos_ids == tuple(want)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert prompts.folder_tokenizer(folder).eos_ids == (2,)  # none there: config.json's


@pytest.mark.parametrize("kind", ["BertProcessing", "RobertaProcessing"])
def test_bert_and_roberta_templates_give_their_cls(kind):
    """BERT's and RoBERTa's post-processors hold ``cls`` as (token, id): the prompt is the cls id and the text,
    as the library's own encoding gives them, without the sep after."""
    from tokenizers import processors

    tokenizer = _tokenizer("<s> $A")
    tokenizer.post_processor = getattr(processors, kind)(("</s>", 2), ("<s>", 1))  # (sep, cls)
    full = tokenizer.encode("hello world").ids
    assert full[0] == 1 and full[-1] == 2
    assert prompts.template_prefix(tokenizer) == [1]
    assert prompts.prompt_ids(tokenizer, "hello world").tolist() == full[:-1]


def test_add_bos_token_with_a_bos_the_tokenizer_lacks_is_refused(tmp_path):
    settings = {"add_bos_token": True, "bos_token": "<bos>"}  # tokenizer.json has <s>, not <bos>
    folder = _folder(tmp_path / "nobos", "$A", tokenizer_config=settings)
    with pytest.raises(ValueError, match="sets add_bos_token but its bos_token '<bos>' is not in tokenizer.json"):
        prompts.folder_tokenizer(folder)
