"""A small source tree for the data tests: Python files, and one each of the files a source skips."""


def write_corpus(root, n=30):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # é€😀\n" * (i % 5 + 1))
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (root / "empty.py").write_text("  \n")
    (root / ".hidden").write_text("never read")
    return root
