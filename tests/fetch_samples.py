"""Real camera RAW files for the tests, fetched from a package registry (PyPI is reachable
wherever darkroom installs): `make` runs this before the tests, and the tests read the files
from `.cache/samples/`. Each file is checked against its SHA-256; the archive it comes in is
checked against the index's hash.

    python tests/fetch_samples.py DEST_DIR
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

# (saved as, PyPI project, sdist, member, the member's SHA-256, what it is)
SAMPLES = [
    (
        "sony-ilce-7rm3.arw",
        "libraw-cffi",
        "libraw_cffi-0.19.0.tar.gz",
        "libraw_cffi-0.19.0/libraw_cffi/tests/_DSC2164.ARW",
        "42ec55eef6047c1bfbd1fd05fdcae78993f3513814138eff4cbcf9498c57d4e6",
        "Sony ILCE-7RM3 ARW (MIT, libraw-cffi's test file): 1616×1080 preview, 5184×3464 sensor",
    ),
]


def _sdist(project: str, filename: str) -> bytes:
    index = urllib.request.Request(
        f"https://pypi.org/simple/{project}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(index, timeout=60) as reply:
        files = json.load(reply)["files"]
    entry = next(f for f in files if f["filename"] == filename)
    with urllib.request.urlopen(entry["url"], timeout=300) as reply:
        data = bytes(reply.read())
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise SystemExit(f"{filename}: not the archive the index lists")
    return data


def fetch(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, project, filename, member, sha256, _ in SAMPLES:
        target = dest / name
        if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == sha256:
            continue
        with tarfile.open(fileobj=io.BytesIO(_sdist(project, filename))) as archive:
            extracted = archive.extractfile(member)
            data = extracted.read() if extracted else b""
        if hashlib.sha256(data).hexdigest() != sha256:
            raise SystemExit(f"{name}: {member} of {filename} is not the file the tests expect")
        target.write_bytes(data)


if __name__ == "__main__":
    fetch(Path(sys.argv[1]))
