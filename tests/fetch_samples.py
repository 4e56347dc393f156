"""Real camera RAW files for the tests, fetched from package registries (PyPI and Debian's
archive are reachable wherever darkroom installs): `make` runs this before the tests, and the
tests read the files from `.cache/samples/`. Each archive is checked against its SHA-256 (the
index's or the Debian source package's), and each file taken from it against its own.

    python tests/fetch_samples.py DEST_DIR
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import os
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple


class Sample(NamedTuple):
    saved_as: str
    archive: str  # a PyPI sdist ("pypi:PROJECT/FILE") or a path in Debian's pool
    archive_sha256: str  # empty for PyPI: the index's own hash is checked instead
    member: str
    sha256: str
    what: str


# Debian's pool, then where a release's pool goes once it is archived (bookworm's, about 2028)
DEBIAN = ("http://deb.debian.org/debian/pool/main", "http://archive.debian.org/debian/pool/main")
ATTEMPTS = 3  # a network hiccup must not fail a CI run
SAMPLES = [
    Sample(
        "sony-ilce-7rm3.arw",
        "pypi:libraw-cffi/libraw_cffi-0.19.0.tar.gz",
        "",
        "libraw_cffi-0.19.0/libraw_cffi/tests/_DSC2164.ARW",
        "42ec55eef6047c1bfbd1fd05fdcae78993f3513814138eff4cbcf9498c57d4e6",
        "Sony ILCE-7RM3 ARW (MIT, libraw-cffi's test file): 1616×1080 preview, 5184×3464 sensor",
    ),
    Sample(
        "canon-eos-r6-pruned.cr3",
        "debian:e/exiv2/exiv2_0.27.6.orig.tar.gz",
        "f16ee5ff08b6994c66106109417857f13e711fca100ac43c6a403d4f02b59602",
        "exiv2-0.27.6/test/data/Canon-R6-pruned.CR3",
        "7925cecf128cb8e272853d3b590031d250ac97a60a937b9044c446081a0104ec",
        "Canon EOS R6 CR3 (GPL-2+, exiv2's test file): 1620×1080 preview, sensor data pruned",
    ),
]


def _get(urls: list[str | urllib.request.Request], timeout_s: float = 60) -> bytes:
    """The first of `urls` that answers whole, each tried ATTEMPTS times."""
    failed = []
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(2**attempt)
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as reply:
                    return bytes(reply.read())
            # URLError and timeouts are OSErrors; a connection cut mid-body is IncompleteRead
            except (OSError, http.client.HTTPException) as exc:
                name = url.full_url if isinstance(url, urllib.request.Request) else url
                failed.append(f"{name}: {exc!r}")
    raise SystemExit("could not fetch a test sample:\n  " + "\n  ".join(failed))


def _archive(sample: Sample) -> bytes:
    kind, _, path = sample.archive.partition(":")
    if kind == "debian":
        data = _get([f"{pool}/{path}" for pool in DEBIAN])
        expected = sample.archive_sha256
    else:
        project, filename = path.split("/")
        index = urllib.request.Request(
            f"https://pypi.org/simple/{project}/",
            headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        )
        files = json.loads(_get([index]))["files"]
        entry = next((f for f in files if f["filename"] == filename), None)
        if entry is None:
            raise SystemExit(f"PyPI lists no {filename} for {project} any more")
        data, expected = _get([entry["url"]]), entry["hashes"]["sha256"]
    if hashlib.sha256(data).hexdigest() != expected:
        raise SystemExit(f"{sample.archive}: not the archive expected (SHA-256)")
    return data


def fetch(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for sample in SAMPLES:
        target = dest / sample.saved_as
        if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == sample.sha256:
            continue
        with tarfile.open(fileobj=io.BytesIO(_archive(sample))) as archive:
            extracted = archive.extractfile(sample.member)
            data = extracted.read() if extracted else b""
        if hashlib.sha256(data).hexdigest() != sample.sha256:
            raise SystemExit(f"{sample.saved_as}: {sample.member} is not the file expected")
        partial = target.with_name(target.name + ".partial")  # no reader sees half a file
        partial.write_bytes(data)
        os.replace(partial, target)


if __name__ == "__main__":
    fetch(Path(sys.argv[1]))
