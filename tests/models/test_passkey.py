"""Passkey retrieval: the generated prompts, the answer check, the tables, and (with the GGUF) a real retrieval."""
from __future__ import annotations

import pytest

from models import passkey


def byte_encode(text):
    """A stand-in tokenizer: one token per UTF-8 byte (no download needed)."""
    return list(text.encode())


@pytest.mark.parametrize("n_tokens", [600, 1000, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_case_has_the_length_and_the_needle_at_its_depth(n_tokens, depth):
    case = passkey.make_case(byte_encode, n_tokens, depth, seed=7)
    assert len(case.ids) == n_tokens
    assert len(case.passkey) == 5 and case.passkey.isdigit()
    text = bytes(case.ids).decode()
    needle = passkey._needle(case.passkey).encode()
    assert bytes(case.ids[case.needle_position:case.needle_position + len(needle)]) == needle
    assert case.needle_length == len(needle)
    assert text.count(case.passkey) == 2  # only the needle holds it; the filler has no digits
    head = len(byte_encode(text[:text.index(passkey.INSTRUCTION)] + passkey.INSTRUCTION + "\n"))
    hay = n_tokens - head - len(needle) - len(byte_encode(text[text.rindex(passkey.QUESTION) - 1:]))
    longest = max(len(s) + 1 for s in passkey.FILLER)  # a sentence boundary lies at most this far away
    assert abs(case.needle_position - head - depth * hay) <= longest
    assert text.endswith(f"<|im_start|>assistant\n{passkey.ANSWER_PREFIX}")


def test_cases_are_reproducible_and_differ_by_seed():
    a, b = (passkey.make_case(byte_encode, 800, 0.5, seed=s) for s in (3, 3))
    c = passkey.make_case(byte_encode, 800, 0.5, seed=4)
    assert a == b
    assert a.ids != c.ids


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth must be a number within"):
        passkey.make_case(byte_encode, 800, 1.5, seed=0)
    with pytest.raises(ValueError, match="depth must be a number within"):
        passkey.make_case(byte_encode, 800, "0.5", seed=0)  # (a comparison error before)
    with pytest.raises(ValueError, match="n_tokens must be an int"):
        passkey.make_case(byte_encode, 1024.5, 0.5, seed=0)  # (a slice error before)
    with pytest.raises(ValueError, match="n_tokens=100 leaves no room") as refused:
        passkey.make_case(byte_encode, 100, 0.5, seed=0)
    least = int(str(refused.value).split("needs >= ")[1].rstrip(")"))  # the message's least length is taken
    assert len(passkey.make_case(byte_encode, least, 0.5, seed=0).ids) == least
    with pytest.raises(ValueError, match="leaves no room"):
        passkey.make_case(byte_encode, least - 1, 0.5, seed=0)


@pytest.mark.parametrize("depths, capacities, pattern", [
    ([2.0], [64], "depths must be numbers within"), ([0.5], [8], "capacity 8 for snapkv: capacity must exceed window"),
    ([0.5], [0], "capacities must be ints >= 1"), ([0.5], [1], "capacity 1 for snapkv"), (["0.5"], [64], "depths"),
])
def test_bad_depths_and_capacities_are_refused_before_any_run(depths, capacities, pattern):
    class Model:  # nothing may call it
        context_length = 8192

        def __getattr__(self, name):
            raise AssertionError(f"evaluate used the model ({name}) before refusing")

    with pytest.raises(ValueError, match=pattern):
        passkey.evaluate(Model(), contexts=[512], depths=depths, capacities=capacities)


def test_contexts_past_the_models_are_refused_before_any_run():
    class Model:  # a model with a context of 1024 tokens, which nothing may call
        context_length = 1024

        def __getattr__(self, name):
            raise AssertionError(f"evaluate used the model ({name}) before refusing")

    with pytest.raises(ValueError, match=r"contexts \[1020\] and max_new_tokens 8 exceed the model's context of "
                                         r"1024 tokens"):
        passkey.evaluate(Model(), contexts=[512, 1020], max_new_tokens=8)


@pytest.mark.parametrize("answer, found", [(" 12345. It", True), ("12345", True), ("1234", False),
                                           (" 123456", False), ("not 54321 but 12345", False), ("", False),
                                           ("a magical key", False)])
def test_answer_found_reads_the_first_number(answer, found):
    assert passkey.answer_found(answer, "12345") is found


def test_accuracy_table_averages_over_depths():
    rows = [{"n": 1024, "depth": d, "policy": p, "capacity": c, "correct": ok}
            for d, p, c, ok in [(0.1, "full", 1024, 1), (0.5, "full", 1024, 0), (0.1, "snapkv", 128, 1),
                                (0.5, "snapkv", 128, 1), (0.1, "h2o", 128, 0), (0.5, "h2o", 128, 0)]]
    table = passkey.accuracy_table(rows)
    assert table == {("full", None, 1024): 0.5, ("snapkv", 128, 1024): 1.0, ("h2o", 128, 1024): 0.0}
    text = passkey.format_table(table, [1024, 2048])
    assert "| full | 50% | = full |" in text and "| snapkv 128 | 100% | = full |" in text


def test_retrieval_with_the_real_model():
    pytest.importorskip("gguf", reason="the model extra (gguf, tokenizers) is not installed: pip install -e .[model]")
    pytest.importorskip("tokenizers", reason="the model extra is not installed: pip install -e .[model]")
    from models.smollm2 import SmolLM2, fetch_gguf

    try:
        model = SmolLM2(fetch_gguf())
    except RuntimeError as err:
        pytest.skip(f"SmolLM2 GGUF not available: {err}")
    rows = passkey.evaluate(model, contexts=(1024,), depths=(0.5,), capacities=(128, 512))
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        ("full", 1024), ("snapkv", 128), ("snapkv", 512), ("streaming", 128), ("streaming", 512), ("h2o", 128),
        ("h2o", 512)]
    by = {(r["policy"], r["capacity"]): r for r in rows}
    # measured on this seed: the full cache and SnapKV at 512 (which sees the question) both read the passkey back;
    # StreamingLLM at 128 keeps only the last 124 tokens, far from the needle at the middle, and cannot
    assert by["full", 1024]["correct"] and by["snapkv", 512]["correct"]
    assert not by["streaming", 128]["correct"]
