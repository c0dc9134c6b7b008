"""Reaching the Hugging Face Hub: fail at once, with a message that suggests a local copy,
rather than after datasets' HTTP retries."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import datasets
from huggingface_hub import constants as hub_constants


def check_hub_reachable(name: str, timeout: float = 3.0) -> None:
    """Fail fast when the Hub cannot be reached (offline mode still reads the local cache)."""
    if hub_constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        return  # offline mode: datasets reads its cache and fails at once if the data is not there
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(endpoint, timeout=timeout)
    except urllib.error.HTTPError:
        pass  # an HTTP answer, even an error status, means the Hub is reachable
    except (urllib.error.URLError, OSError) as e:
        raise ConnectionError(offline_message(name, reason=f"{endpoint} unreachable: {e}")) from e


def offline_message(name: str, reason: str) -> str:
    """Why Hub dataset `name` cannot be loaded, and what to do instead."""
    return (f"cannot load Hub dataset {name!r} ({reason}). Without network, download it "
            "elsewhere and use a local source instead, e.g. `data=local data.source.paths="
            "[/path/to/files]`; if it is already in your Hugging Face cache, set "
            "HF_HUB_OFFLINE=1.")
