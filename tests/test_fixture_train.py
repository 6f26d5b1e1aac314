"""The fixture's training data (sparkinfer/fixture/train.py): the curriculum's repeated windows and
the induction targets the head supervision reads. No model: these run on the system python."""

import random

from sparkinfer.fixture import data, train


def _period(w: list[int]) -> int:
    """The shortest p with w[i] == w[i - p] for every i >= 1 + p (position 0 is <s>)."""
    body = w[1:]
    return next(p for p in range(1, len(body)) if all(body[i] == body[i - p] for i in range(p, len(body))))


def test_repeat_mix_windows_are_random_id_sequences_repeated():
    stream = list(range(data.FIRST_WORD, data.VOCAB)) * 4
    windows = train.make_batch(stream, random.Random(3), batch=8, mix="repeat")
    assert len(windows) == 8
    for w in windows:
        assert len(w) == train.CONTEXT + 2 and w[0] == 0
        assert all(data.FIRST_WORD <= t < data.VOCAB for t in w[1:])
        assert 16 <= _period(w) <= 64


def test_induction_targets_point_after_the_last_earlier_trigram():
    w = [5, 6, 7, 8, 5, 6, 7, 9, 6, 7, 8]
    t = train.induction_targets(w)
    assert t[:6] == [-1] * 6  # trigrams (5,6,7) at 2 and 6: the first repeat is at 6
    assert t[6] == 3  # (5, 6, 7) ended at 2: its next token is at 3
    assert t[7] == -1  # (6, 7, 9) is new
    assert t[10] == 4 and w[4] == 5  # (6, 7, 8) ended at 3: the key is 4


def test_a_carried_topics_file_is_the_corpus_and_its_hash_tells(tmp_path, monkeypatch):
    """``SPARKINFER_FIXTURE_TOPICS`` (the GPU run carries CPython 3.11.7's file): this Python's own
    file gives the same corpus and hash; one changed topic changes the hash, which is what
    benchmarks/device/train_fixture.sh checks before it trains."""
    import pydoc_data.topics

    own = data.corpus_sha256()
    monkeypatch.setenv(data.TOPICS_ENV, pydoc_data.topics.__file__)
    assert data.corpus_sha256() == own and data.topics() == dict(sorted(pydoc_data.topics.topics.items()))
    changed = dict(pydoc_data.topics.topics, assert_="changed")
    path = tmp_path / "topics.py"
    path.write_text(f"topics = {changed!r}\n")
    monkeypatch.setenv(data.TOPICS_ENV, str(path))
    assert data.topics()["assert_"] == "changed" and data.corpus_sha256() != own
