"""Prepared token shards in object storage (data.cache_dir=s3://... or gs://...): tokenized on a local disk,
then published to the bucket, where training reads them a window at a time by byte ranges (lm/data/loaders.py)
and lm/data/meta.py checks them.

    staging    where a prepare for a URL tokenizes: a local directory named by the URL, where a killed prepare
               continues, deleted once published
    publish    the staging directory -> URL: meta.json deleted first (until it is back the URL is not prepared),
               the shards and rank file uploaded, the shards of an older prepare deleted, and meta.json written
               last, recording each object's size and version (ETag or generation)
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from lm import storage
from lm.data.meta import META, PROGRESS
from lm.files import write_json


def staging(url: str) -> str:
    return storage.work_place(url, "lm-prepare")


def publish(local: str, url: str, meta: dict, progress: bool = True) -> dict:
    """Upload prepared directory `local` to `url` (meta.json last) and delete `local`; the meta written there."""
    url = url.rstrip("/")
    storage.remove(f"{url}/{META}")
    names = sorted(n for n in os.listdir(local) if n not in (META, PROGRESS) and not n.startswith("."))
    if progress:
        print(f"uploading {len(names)} files to {url}", file=sys.stderr)
    storage.upload([os.path.join(local, name) for name in names], [f"{url}/{name}" for name in names])
    listed = storage.objects(url)
    for stale in sorted(set(listed) - set(names)):
        if re.fullmatch(r"tokens-\d+\.bin", stale):  # a shard of an older, longer prepare (nothing else is touched)
            storage.remove(f"{url}/{stale}")
    meta = {**meta, "objects": {name: listed[name] for name in names}}
    write_json(f"{url}/{META}", meta)
    shutil.rmtree(local)
    return meta
