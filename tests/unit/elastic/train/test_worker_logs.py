import sys

from elastic.train.worker_logs import LineBuffer, forward_output


def test_lines_are_split_per_stream_and_partials_kept() -> None:
    buf = LineBuffer()
    buf.write("stdout", "hello wor")
    buf.write("stderr", "oops\n")
    buf.write("stdout", "ld\nnext")
    assert [(s, t) for _, s, t in buf.take()] == [("stderr", "oops"), ("stdout", "hello world")]
    assert buf.take() == []
    assert [(s, t) for _, s, t in buf.take(final=True)] == [("stdout", "next")]


def test_a_flood_drops_the_oldest_and_says_so() -> None:
    buf = LineBuffer(max_pending=3)
    for i in range(5):
        buf.write("stdout", f"{i}\n")
    assert [t for _, _, t in buf.take()] == ["[elastic-train: 2 log lines dropped]", "2", "3", "4"]


def test_forward_output_tees_and_restores(capsys) -> None:  # type: ignore[no-untyped-def]
    sent: list[list] = []
    with forward_output(sent.extend):
        print("to the job log")
        print("and to stderr", file=sys.stderr)
    print("after: not forwarded")
    assert [(s, t) for _, s, t in sent] == [
        ("stdout", "to the job log"),
        ("stderr", "and to stderr"),
    ]
    out = capsys.readouterr()
    assert out.out == "to the job log\nafter: not forwarded\n"
    assert out.err == "and to stderr\n"
