"""``flax-transformer generate --checkpoint FOLDER`` on HF and Meta folders, each with its own tokenizer, and the
one prompt rule that ``generate`` and ``verify --bisect-generate`` share (``training.prompts.prompt_ids``).

One random tiny transformers ``LlamaForCausalLM`` (2 layers, hidden 32, 4 query heads on 2 key/value heads,
vocabulary 600, weights drawn with std 0.5 so that greedy choices are not float32 ties) is written three ways:
an HF folder by ``save_pretrained`` with a BPE ``tokenizer.json`` trained here with the ``tokenizers`` library
(``<s>`` before a text, ``<unk>`` and no byte fallback), and two Meta folders (``consolidated.00.pth`` +
``params.json``, q/k rows in Meta's interleaved order) with a ``tokenizer.model``: a SentencePiece BPE trained
here with Llama 2's settings (byte fallback, identity normaliser), and tiktoken BPE ranks written here (the 256
bytes and a few merges; Meta's 256 special tokens after them). The references are independent of this library:
transformers' ``generate`` (greedy) on the same weights, transformers' tokenizer for the HF folder,
``SentencePieceProcessor.encode`` and ``tiktoken.Encoding.encode`` for the Meta ones. A tiny GPT-2 with a
byte-level tokenizer.json is the slow run's.
"""

import base64
import json
import shutil

import numpy as np
import pytest

from flax_transformer.cli import folder_generation, generation_cli
from flax_transformer.cli.commands import main
from flax_transformer.training import hf_init, lm, prompts
from flax_transformer.training.errors import RunError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the README's set-up installs it)")
torch = pytest.importorskip("torch")
from parity_tests.interop.test_meta_llama import meta_files, meta_state  # noqa: E402 - after the skips

LINES = ["ROMEO: but soft, what light through yonder window breaks?",
         "JULIET: O Romeo, Romeo! wherefore art thou Romeo?",
         "MERCUTIO: a plague o' both your houses! they have made worms' meat of me."]
VOCAB = 600
PARAMS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32, norm_eps=1e-5,
              rope_theta=10000.0)  # Meta's FeedForward: 32 * ceil(int(2 * 4 * 32 / 3) / 32) = 96
MERGES = [b"RO", b"ME", b"O:", b" R", b"om", b"eo", b"Rom", b"Romeo", b"ht", b" wh", b"ou"]
NEW = 16


def _bpe_folder(folder):
    """Write a Llama-like BPE tokenizer.json (Metaspace pieces, ``<s>`` before a text, ``<unk>``, no byte fallback)
    built with ``tokenizers``, and the tokenizer_config.json transformers reads beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    bpe.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def _sentencepiece(path):
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(  # Llama 2's tokenizer.model settings
        sentence_iterator=iter(LINES * 20), model_prefix=str(path / "tokenizer"), vocab_size=320, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True)
    (path / "tokenizer.vocab").unlink()
    return spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))


def _ranks(path):
    tiktoken = pytest.importorskip("tiktoken")
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
    (path / "tokenizer.model").write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    specials = {token: len(ranks) + i for i, token in enumerate(prompts.LLAMA3_SPECIALS)}  # Meta's tokenizer.py
    return tiktoken.Encoding("llama3-tiny", pat_str=TikTokenConverter(vocab_file="").pattern, mergeable_ranks=ranks,
                             special_tokens=specials)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(folder, transformers model, SentencePiece processor, tiktoken encoding)."""
    tmp = tmp_path_factory.mktemp("folders")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, initializer_range=0.5,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp / "hf")
    _bpe_folder(tmp / "hf")
    state = meta_state(model)
    sp = _sentencepiece(meta_files(tmp / "meta_spm", state, params=PARAMS))
    encoding = _ranks(meta_files(tmp / "meta_tt", state, params=PARAMS))
    return tmp, model, sp, encoding


def _greedy(model, ids, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, **kwargs)
    return out[0].tolist()


def _generate(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_hf_folder_continues_as_transformers_generate(made, capsys):
    tmp, model, _, _ = made
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "hf")
    prompt = "ROMEO: but soft"
    want = _greedy(model, tok(prompt).input_ids)
    got = folder_generation.continue_folder(tmp / "hf", prompt, max_new_tokens=NEW, greedy=True)
    assert got.prompt.tolist() == tok(prompt).input_ids  # <s> first, as transformers' tokenizer gives it
    assert got.prompt.tolist() + got.new.tolist() == want  # token for token
    code, out, _ = _generate(capsys, "--checkpoint", tmp / "hf", "--prompt", prompt, "--max-new-tokens", NEW)
    assert code == 0 and out == tok.decode(want, skip_special_tokens=True) + "\n"  # greedy: generation_config's



def test_generation_config_budget_and_stop_as_transformers_generate(made, tmp_path):
    """generation_config.json's max_length without max_new_tokens leaves max_length less the prompt for new
    tokens; a stop id that is reached (the second of a list, as Llama 3 Instruct's <|eot_id|>) ends the new ids
    and is kept, as transformers' generate keeps it. The prompt and budget of the test above: one compiled loop."""
    tmp, model, _, _ = made
    folder = shutil.copytree(tmp / "hf", tmp_path / "hf")
    prompt = "ROMEO: but soft"
    tokens = prompts.folder_tokenizer(folder)
    ids = prompts.prompt_ids(tokens.tokenizer, prompt, prefix=tokens.prefix).tolist()
    saved = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(saved | {"max_length": len(ids) + NEW}))
    want = _greedy_as_folder(model, ids, folder)
    assert len(want) == len(ids) + NEW  # no stop reached: the budget alone ends it
    got = folder_generation.continue_folder(folder, prompt)
    assert got.prompt.tolist() + got.new.tolist() == want
    new = want[len(ids):]
    stop = next(t for k, t in enumerate(new) if k and t not in new[:k] and t != 2)  # reached, not at once
    (folder / "generation_config.json").write_text(json.dumps(saved | {"eos_token_id": [2, stop]}))
    want = _greedy_as_folder(model, ids, folder, max_new_tokens=NEW)
    assert want[-1] == stop and len(want) < len(ids) + NEW
    got = folder_generation.continue_folder(folder, prompt, max_new_tokens=NEW)
    assert got.prompt.tolist() + got.new.tolist() == want


def test_a_tokenizer_as_large_as_the_model_and_a_budget_cut_to_the_table(made, tmp_path, monkeypatch):
    """A tokenizer with exactly the model's vocabulary is accepted; a prompt that leaves less room in the
    position table (64) than the default 32 new tokens asks the loop for that room, no more (the loop itself
    replaced by a recorder here: a prompt this long would compile a program of its own, seconds)."""
    from flax_transformer.models import generate

    tmp, model, _, _ = made
    folder = shutil.copytree(tmp / "hf", tmp_path / "hf")
    tokenizer = prompts.folder_tokenizer(folder).tokenizer
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(VOCAB - tokenizer.get_vocab_size(with_added_tokens=True))])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    tokenizer.save(str(folder / "tokenizer.json"))
    prompt = " ".join(LINES[:2])
    tokens = prompts.folder_tokenizer(folder)
    ids = prompts.prompt_ids(tokens.tokenizer, prompt, prefix=tokens.prefix).tolist()
    room = model.config.max_position_embeddings - len(ids)
    assert 0 < room < folder_generation.DEFAULT_NEW_TOKENS
    asked = []

    def recorder(model, input_ids, max_new_tokens, **kwargs):
        asked.append(max_new_tokens)
        return np.full((1, max_new_tokens), 3, np.int32)

    monkeypatch.setattr(generate, "generate", recorder)
    got = folder_generation.continue_folder(folder, prompt)  # no budget given: 32, cut to the table
    assert asked == [room] and got.prompt.tolist() == ids and len(got.new) == room


def _greedy_as_folder(model, ids, folder, **kwargs) -> list[int]:
    """transformers' generate with the folder's generation_config.json, as its own from_pretrained reads it."""
    config = transformers.GenerationConfig.from_pretrained(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=config, **kwargs)
    return out[0].tolist()

def test_meta_tokenizers_read_as_their_own_libraries(made):
    """tokenizer.model converted by transformers' converters: SentencePiece's and tiktoken's own ids, BOS first."""
    tmp, _, sp, encoding = made
    tokens = prompts.folder_tokenizer(tmp / "meta_spm")
    assert tokens.eos_ids == (2,) and tokens.prefix == (1,)
    for text in ["ROMEO: soft", " two  spaces", "é zq\nnew 123", "<s> literal </s>", ""]:
        assert prompts.prompt_ids(tokens.tokenizer, text, prefix=tokens.prefix).tolist() == [1, *sp.encode(text)]
    tokens = prompts.folder_tokenizer(tmp / "meta_tt")
    bos = encoding.encode("<|begin_of_text|>", allowed_special="all")
    for text in ["ROMEO: Romeo", "é  x\n\n1234 what", "<|eot_id|>", ""]:  # a special token's text is one
        assert prompts.prompt_ids(tokens.tokenizer, text, prefix=tokens.prefix).tolist() == bos + encoding.encode(
            text, allowed_special="all")
    stops = [encoding.encode(s, allowed_special="all")[0] for s in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    assert list(tokens.eos_ids) == stops


@pytest.mark.slow(reason="test_hf_folder_continues_as_transformers_generate, "
                  "test_meta_tokenizers_read_as_their_own_libraries")
def test_meta_folders_continue_as_transformers_generate(made, capsys):
    """Greedy: token for token as transformers' generate on the same weights, for both tokenizers; sampled:
    reproducible with --seed."""
    tmp, model, sp, encoding = made
    prompt = "JULIET: O Romeo"
    got = folder_generation.continue_folder(tmp / "meta_spm", prompt, max_new_tokens=NEW, greedy=True)
    assert got.prompt.tolist() + got.new.tolist() == _greedy(model, [1, *sp.encode(prompt)], eos_token_id=2)
    sampled = [_generate(capsys, "--checkpoint", tmp / "meta_spm", "--prompt", prompt, "--max-new-tokens", NEW,
                         "--temperature", 1.5, "--seed", seed)[1] for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]  # the seed decides, and is used
    stops = list(prompts.folder_tokenizer(tmp / "meta_tt").eos_ids)
    bos = encoding.encode("<|begin_of_text|>", allowed_special="all")
    got = folder_generation.continue_folder(tmp / "meta_tt", prompt, max_new_tokens=NEW, greedy=True)
    assert got.prompt.tolist() + got.new.tolist() == _greedy(model, bos + encoding.encode(prompt), eos_token_id=stops)


def test_unknown_characters_are_refused_by_name(made, capsys):
    """An HF tokenizer without byte fallback would turn them into <unk>: generate, a run's prompt and
    --bisect-generate refuse them in one line, naming them."""
    tmp = made[0]
    code, out, err = _generate(capsys, "--checkpoint", tmp / "hf", "--prompt", "ROMEO: soft é Zed")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "cannot encode ('é', 'Z')" in err
    tokenizer = prompts.folder_tokenizer(tmp / "hf").tokenizer
    config = lm.LMConfig(model="hf", init="unused", prompt="ROMEO: soft é")
    with pytest.raises(RunError, match="cannot encode \\('é'\\)"):  # a train.lm --model hf run's prompt
        lm.prompt_ids(config, tokenizer)
    code = main(["verify", "--checkpoint", str(tmp / "hf"), "--bisect-generate", "--prompt", "soft é"])
    assert code == 2 and "cannot encode ('é')" in capsys.readouterr().err


def test_one_prompt_rule_for_generate_and_bisect_generate(made, tmp_path):
    """An empty prompt keeps the BOS its template puts before a text, in both paths; without a BOS it is
    refused in both; a non-empty one gives the same ids everywhere."""
    tmp = made[0]
    tokenizer = prompts.folder_tokenizer(tmp / "hf").tokenizer
    for text in ["", "ROMEO: soft"]:
        run_ids = lm.prompt_ids(lm.LMConfig(model="hf", init="unused", prompt=text), tokenizer)
        bisect_ids = generation_cli.prompt_ids(tmp / "hf", text)
        assert run_ids.tolist() == bisect_ids.tolist() == hf_init.prompt_ids(tokenizer, text).tolist()
        assert run_ids[0] == 1  # <s>
    assert generation_cli.prompt_ids(tmp / "hf", "").tolist() == [1]
    plain = tmp_path / "plain"  # the same folder, its template without a BOS: GPT-2's and Qwen's way
    plain.mkdir()
    tokenizer.post_processor = None
    tokenizer.save(str(plain / "tokenizer.json"))
    with pytest.raises(ValueError, match="--prompt gives no tokens"):
        generation_cli.prompt_ids(plain, "")
    with pytest.raises(RunError, match="--prompt gives no tokens"):
        lm.prompt_ids(lm.LMConfig(model="hf", init="unused", prompt=""), tokenizer)
    (plain / "tokenizer_config.json").write_text('{"add_bos_token": true, "bos_token": "<s>"}')
    assert generation_cli.prompt_ids(plain, "").tolist() == [1]  # tokenizer_config.json's add_bos_token decides


def test_refusals(made, tmp_path, capsys):
    tmp = made[0]
    (tmp_path / "empty").mkdir()
    code, _, err = _generate(capsys, "--checkpoint", tmp_path / "empty", "--prompt", "x")
    assert code == 2 and "neither a train.lm run" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tmp / "hf" / name).read_bytes())
    code, _, err = _generate(capsys, "--checkpoint", bare, "--prompt", "x")
    assert code == 2 and "has no tokenizer.json or tokenizer.model" in err


def test_generation_config_decides_sampling(made):
    assert folder_generation.sampling({}, greedy=False, temperature=None, top_k=None, top_p=None) == {"greedy": True}
    chosen = folder_generation.sampling({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, greedy=False,
                                        temperature=None, top_k=None, top_p=None)
    assert chosen == dict(greedy=False, temperature=0.6, top_k=50, top_p=0.9)  # transformers' default top_k 50
    assert folder_generation.sampling({"do_sample": True}, greedy=True, temperature=None, top_k=None,
                                      top_p=None) == {"greedy": True}
    assert folder_generation.sampling({}, greedy=False, temperature=0.7, top_k=0, top_p=None) == dict(
        greedy=False, temperature=0.7, top_k=None, top_p=1.0)
    assert folder_generation.not_computed({"repetition_penalty": 1.1, "num_beams": 1}) == ("repetition_penalty=1.1",)
    # null and [] are transformers' "none" too (GenerationConfig's defaults): nothing to name
    assert folder_generation.not_computed({"repetition_penalty": None, "bad_words_ids": [], "suppress_tokens": [],
                                           "min_p": None}) == ()


def test_a_beam_search_is_named_as_not_computed():
    """``num_beams`` 4 asks for a beam search, which this loop does not run: named on stderr (the tokens are not
    transformers'); every field at its neutral value names nothing."""
    assert folder_generation.not_computed({"num_beams": 4, "do_sample": False}) == ("num_beams=4",)
    assert folder_generation.not_computed(dict(folder_generation.NOT_COMPUTED)) == ()

@pytest.mark.slow(reason="test_hf_folder_continues_as_transformers_generate")
def test_gpt2_folder_continues_as_transformers_generate(tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(fast), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, initializer_range=0.5)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    prompt = "JULIET: O Romeo, Romeo!"
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path)(prompt).input_ids
    want = _greedy(model, ids)
    got = folder_generation.continue_folder(tmp_path, prompt, max_new_tokens=NEW)
    assert got.prompt.tolist() == ids and got.prompt.tolist() + got.new.tolist() == want
    code, out, _ = _generate(capsys, "--checkpoint", tmp_path, "--prompt", prompt, "--max-new-tokens", NEW)
    assert code == 0 and out == fast.decode(want, skip_special_tokens=True) + "\n"
