"""The text and chat API on the embedded default model."""

import threading

from runtime import GenerationConfig
from runtime.text import Detokenizer

GREEDY = GenerationConfig(max_new_tokens=32)


def test_chat_answers_and_ends_at_eos(smollm):
    handle = smollm.launch_response([{"role": "user", "content": "What is the capital of France?"}],
                                    GenerationConfig(max_new_tokens=64))
    tokens = list(smollm.stream_response_tokens(handle))
    assert tokens[-1] in smollm.eos_token_ids, "the checkpoint's EOS should end this short answer"
    assert "Paris" in smollm.tokenizer.decode(tokens)


def test_stream_pieces_join_into_response(smollm):
    prompt = [{"role": "user", "content": "Name three colours."}]
    pieces = list(smollm.stream_response(prompt, GREEDY))
    assert len(pieces) > 3
    assert "".join(pieces) == smollm.response(prompt, GREEDY)


def test_detokenizer_never_splits_a_character(smollm):
    text = "Thread 🧵 safety: naïve café, 漢字 and ünïcödé — done."
    tokens = smollm.tokenizer(text, add_special_tokens=False)["input_ids"]
    detokenizer = Detokenizer(smollm.tokenizer)
    pieces = [detokenizer.push(t) for t in tokens] + [detokenizer.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_string_ends_generation_and_is_not_returned(smollm):
    prompt = "List the numbers from one to ten: one, two, three,"
    full = smollm.response(prompt, GREEDY)
    stop = "five"
    assert stop in full, full
    cut = smollm.response(prompt, GenerationConfig(max_new_tokens=32, stop=[stop]))
    assert cut == full[:full.index(stop)]
    assert smollm.stats()["running"] == 0


def test_concurrent_text_requests_from_threads(smollm):
    questions = [f"What is {a} plus {b}?" for a, b in [(1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (6, 1)]]
    alone = {q: smollm.response([{"role": "user", "content": q}], GREEDY) for q in questions[:3]}
    together = {}

    def ask(q):
        together[q] = "".join(smollm.stream_response([{"role": "user", "content": q}], GREEDY))

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(together) == len(questions)
    for q, answer in alone.items():
        assert together[q] == answer


def test_closing_a_stream_early_aborts_its_request(smollm):
    stream = smollm.stream_response([{"role": "user", "content": "Tell me a long story about a dragon."}],
                                    GenerationConfig(max_new_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    stats = smollm.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
