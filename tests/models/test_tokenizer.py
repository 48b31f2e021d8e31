"""Loom's tokenizer (models/checkpoints/tokenizer.py) against transformers' on the same files: the
same ids, text and chat prompts, read back without importing transformers."""

import json
import subprocess
import sys

import jinja2
import pytest
import torch
from transformers import AutoTokenizer

from models.checkpoints.gguf import default_model_path, read_tokenizer, tokenizer_copy
from models.checkpoints.gguf_config import ARCHITECTURES
from models.checkpoints.tokenizer import Tokenizer

TEXTS = ["Hello world!", "  spaces   and\ttabs\n\nnewlines", "<|im_start|>user\nhi<|im_end|>", "<s>hello</s>",
         "héllo wörld 日本語 🚀", "hello the world!", ""]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]


def spm_gguf(path, arch="llama"):
    """An ``arch`` file carrying only a small SentencePiece-style vocabulary (byte fallback, BOS added)
    and a chat template: the other tokenizer kind GGUF files hold, beside SmolLM2's byte-level BPE."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("attention.head_count", 2), ("attention.head_count_kv", 2)]:
        writer.add_uint32(f"{arch}.{key}", value)
    pieces = ["▁", "▁a", "▁the", "▁hello", "▁world", "he", "ll", "o", "wor", "ld", "▁wor", "!", "th", "e", "a", "h"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                             "{% if add_generation_prompt %}[assistant]{% endif %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["smollm2", "spm"])
def pair(request, tmp_path_factory):
    """(Loom's tokenizer read back from the cache, transformers' converted from the file)."""
    path = default_model_path() if request.param == "smollm2" else spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    with pytest.MonkeyPatch.context() as patch:  # a cache of its own, so that the first read converts
        patch.setenv("LOOM_CACHE", str(tmp_path_factory.mktemp("cache")))
        converted, cached = read_tokenizer(path), read_tokenizer(path)
    assert isinstance(converted, Tokenizer) and isinstance(cached, Tokenizer)
    assert converted.chat_template == cached.chat_template and converted.encode(TEXTS[2]) == cached.encode(TEXTS[2])
    return cached, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("special", [True, False], ids=["special", "plain"])
def test_encodes_and_decodes_as_transformers(pair, special):
    ours, theirs = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == theirs.encode(text, add_special_tokens=special), text
        assert ours(text, add_special_tokens=special)["input_ids"] == ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
        assert ours.decode(torch.tensor(ids, dtype=torch.long)) == ours.decode(ids)


def test_chat_prompts_as_transformers(pair):
    ours, theirs = pair
    for chat in CHATS:
        for opened in (True, False):
            text = theirs.apply_chat_template(chat, add_generation_prompt=opened, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=opened, tokenize=False) == text
            assert ours.apply_chat_template(chat, add_generation_prompt=opened) == theirs.encode(text, add_special_tokens=False)


def test_special_tokens_as_transformers(pair):
    ours, theirs = pair
    for role in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, role) == getattr(theirs, role), role
        assert getattr(ours, role + "_id") == getattr(theirs, role + "_id"), role
    assert len(ours) == len(theirs)
    with pytest.raises(AttributeError, match="no attribute 'batch_decode'"):
        ours.batch_decode


def test_saved_files_read_back_by_both(pair, tmp_path):
    ours, _ = pair
    ours.save_pretrained(tmp_path)
    again, theirs = Tokenizer.from_directory(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == theirs.encode(text) == ours.encode(text)
    assert again.apply_chat_template(CHATS[1], tokenize=False) == theirs.apply_chat_template(CHATS[1], tokenize=False)


def test_template_variables_as_transformers_passes_them(pair):
    """A caller's template, documents (None when not given), and a message's reasoning under the
    names templates read it by: rendered as transformers renders them; its other options refused."""
    ours, theirs = pair
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ m.get('reasoning_content', '') }}|{{ m.get('thinking', '') }}]"
                "{% endfor %}{% if documents is not none %}{{ documents | tojson }}{% endif %}")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "reasoning": "thought"}]
    for extra in ({}, {"documents": [{"title": "a", "text": "b"}]}):
        assert (ours.apply_chat_template(chat, chat_template=template, tokenize=False, **extra)
                == theirs.apply_chat_template(chat, chat_template=template, tokenize=False, **extra))
    with pytest.raises(TypeError, match="continue_final_message"):
        ours.apply_chat_template(chat, continue_final_message=True)
    assert ours.decode(ids := ours.encode("hello")[0]) == ours.decode([ids])


def test_template_features_and_errors(pair):
    ours = Tokenizer(pair[0].backend_tokenizer, pair[0].special_tokens_map, {
        "default": "{% generation %}{{ messages[0]['content'] | tojson }}{% endgeneration %}",
        "tool_use": "{% for t in tools %}{{ t['name'] }}{% break %}{% endfor %}",
        "strict": "{{ raise_exception('no system messages') }}",
        "escape": "{% set ns = namespace(_secret=1) %}"})
    # tojson leaves non-ASCII and HTML characters alone, as transformers' does; tools pick tool_use
    assert ours.apply_chat_template([{"role": "user", "content": "<é>", "name": None}], tokenize=False) == '"<é>"'
    assert ours.apply_chat_template([], tools=[{"name": "f"}, {"name": "g"}], tokenize=False) == "f"
    ours.chat_template = ours.chat_template["strict"]
    with pytest.raises(jinja2.TemplateError, match="no system messages"):
        ours.apply_chat_template(CHATS[0])
    ours.chat_template = "{% set ns = namespace(_secret=1) %}"
    with pytest.raises(jinja2.exceptions.SecurityError, match="_secret"):
        ours.apply_chat_template(CHATS[0])
    ours.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="several chat templates"):
        Tokenizer(ours.backend_tokenizer, {}, {"a": "x", "b": "y"}).apply_chat_template(CHATS[0])


def test_a_cached_tokenizer_loads_without_transformers():
    """The point of it: a GGUF whose tokenizer is cached loads without importing transformers (its
    import and tokenizer were 1.6 s of a 2.4 s load)."""
    path = default_model_path()
    read_tokenizer(path)  # converted and cached, where no test has yet
    script = ("import json, sys; from runtime import Engine; engine = Engine.from_pretrained(); "
              "print(json.dumps([engine.encode(%r), 'transformers' in sys.modules]))" % CHATS[0])
    ids, imported = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                              check=True).stdout)
    expected = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).apply_chat_template(
        CHATS[0], add_generation_prompt=True, tokenize=False)
    assert ids == read_tokenizer(path).encode(expected, add_special_tokens=False) and not imported


def test_a_partial_cache_is_replaced_and_nothing_is_left_aside(tmp_path, monkeypatch):
    """The converted files are written aside and renamed whole (replicas starting together each
    convert); an entry missing a file, as one written in place and cut short, is converted again."""
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    path = spm_gguf(tmp_path / "spm.gguf")
    first = read_tokenizer(path)
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    (entry / "tokenizer.json").unlink()
    again = read_tokenizer(path)
    assert [p.name for p in (tmp_path / "cache" / "tokenizers").iterdir()] == [entry.name]
    assert (entry / "tokenizer.json").is_file() and again.encode(TEXTS[5]) == first.encode(TEXTS[5])


def test_the_cache_keeps_merges_as_strings_where_no_token_holds_a_space(tmp_path, monkeypatch):
    """A converted BPE tokenizer's merges are cached as "a b" strings (read a third faster than
    pairs); a merge whose token holds a space stays a pair, since the string form splits at one. The
    cached SmolLM2 tokenizer encoding as transformers' is test_encodes_and_decodes_as_transformers."""
    from models.checkpoints.gguf import _merges_as_strings

    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    read_tokenizer(default_model_path())
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    merges = json.loads((entry / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    assert len(merges) > 40000 and all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)
    spaced = tmp_path / "spaced.json"
    content = {"model": {"type": "BPE", "merges": [["a", "b"], ["c d", "e"]]}}
    spaced.write_text(json.dumps(content))
    _merges_as_strings(spaced)
    assert json.loads(spaced.read_text()) == content


# (SmolLM2's BPE vocabulary takes 12 s a conversion: one architecture under Llama's stand-in reads it, as every
# architecture reads a small SentencePiece one; Gemma's and Phi-3's SentencePiece vocabularies are built otherwise
# than Llama's, by design: Gemma 3n's as Gemma 3's)
@pytest.mark.parametrize("arch, kind", [("smollm3", "bpe")] + [
    (arch, "spm") for arch in sorted(set(ARCHITECTURES) - {"llama", "gemma", "gemma2", "gemma3", "gemma3n", "phi3"})])
def test_every_architectures_file_keeps_its_tokenizer(arch, kind, tmp_path, monkeypatch):
    """Every architecture Loom reads GGUF files of has its tokenizer, whether transformers' GGUF reader
    reads its files or not (SmolLM3, Granite, Mistral 3, ERNIE 4.5, OLMo, gpt-oss: converted from a copy
    of the metadata under Llama's name), equal to the same vocabulary's from a Llama file: SmolLM2's
    byte-level BPE and a SentencePiece-style one, text and chat prompts."""
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    if kind == "bpe":
        llama, other = default_model_path(), tokenizer_copy(default_model_path(), arch, tmp_path / f"{arch}.gguf")
    else:
        llama, other = spm_gguf(tmp_path / "llama.gguf"), spm_gguf(tmp_path / f"{arch}.gguf", arch)
    theirs, ours = read_tokenizer(llama), read_tokenizer(other)
    assert [ours.encode(text) for text in TEXTS] == [theirs.encode(text) for text in TEXTS]
    for chat in CHATS:
        assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
            chat, add_generation_prompt=True)
    assert ours.special_tokens_map == theirs.special_tokens_map


def test_a_gemma_files_tokenizer_is_gemma_2s(tmp_path, monkeypatch):
    """transformers' GGUF reader refuses Gemma 1's architecture ("gemma"): its tokenizer is converted
    from a copy of the metadata under Gemma 2's name, Gemma's SentencePiece build (not Llama's)."""
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    gemma, gemma2 = (read_tokenizer(spm_gguf(tmp_path / f"{arch}.gguf", arch)) for arch in ("gemma", "gemma2"))
    assert [gemma.encode(text) for text in TEXTS] == [gemma2.encode(text) for text in TEXTS]
    assert gemma.special_tokens_map == gemma2.special_tokens_map


def test_a_gemma3n_files_tokenizer_is_gemma_3s(tmp_path, monkeypatch):
    """transformers' GGUF reader takes no "gemma3n" architecture: its tokenizer is converted from a copy of the
    metadata under Gemma 3's name, Gemma's SentencePiece build, as Gemma 3's files are read."""
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    gemma3n, gemma3 = (read_tokenizer(spm_gguf(tmp_path / f"{arch}.gguf", arch)) for arch in ("gemma3n", "gemma3"))
    assert [gemma3n.encode(text) for text in TEXTS] == [gemma3.encode(text) for text in TEXTS]
    assert gemma3n.special_tokens_map == gemma3.special_tokens_map


def test_a_gpt_oss_files_tokenizer_is_read_past_its_rope_metadata(tmp_path, monkeypatch):
    """transformers (5.25) fails on a gpt-oss file's rope.scaling keys, reading their lengths as their
    values, before it converts the tokenizer: Loom converts it from a copy of the tokenizer metadata
    under Llama's name, the same tokenizer as the Llama file's."""
    import gguf

    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "gpt-oss.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, field in gguf.GGUFReader(default_model_path()).fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1
                                 else None)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    theirs, ours = read_tokenizer(default_model_path()), read_tokenizer(path)
    assert [ours.encode(text) for text in TEXTS] == [theirs.encode(text) for text in TEXTS]
