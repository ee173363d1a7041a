"""Hugging Face hub model ids (``'HuggingFaceTB/SmolLM2-135M'``) -> a local snapshot directory.

:func:`load_model` accepts three kinds of names: a shipped architecture name, a local
checkpoint directory, and a hub id ``owner/name`` (optionally ``owner/name@revision``). A hub
id is fetched with :func:`huggingface_hub.snapshot_download`, so everything the hub client
honours applies: the local cache (``HF_HOME`` / ``HF_HUB_CACHE``), offline mode
(``HF_HUB_OFFLINE=1``: only what is already cached, no network), tokens and mirrors
(``HF_ENDPOINT``). Only the files the engine reads are fetched (config, safetensors,
tokenizer), or only config and tokenizer when the weights are not real.

A local directory always wins over a hub id of the same spelling.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Tuple

from hybridgen.errors import MissingDataError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")
#: files the engine and the tokenizer read
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]


def is_hub_id(name: str) -> bool:
    """True for ``owner/name`` (or ``owner/name@rev``) that is not an existing local path."""
    name = str(name)
    if name.startswith((".", "~", os.sep)) or Path(name).expanduser().exists():
        return False
    return bool(_HUB_ID.match(name))


def split_revision(hub_id: str) -> Tuple[str, str | None]:
    """``'owner/name@rev'`` -> ``('owner/name', 'rev')``; no ``@``: revision None (the hub's default)."""
    repo, _, rev = str(hub_id).partition("@")
    return repo, (rev or None)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def snapshot(hub_id: str, weights: bool = True) -> Path:
    """The local snapshot directory of ``hub_id`` (downloaded unless cached; cache only when offline).

    weights: also fetch the safetensors (False: config and tokenizer only). Any failure is a
    one-line MissingDataError naming the fix (offline and not cached, unknown or gated repo,
    no network).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub_errors

    repo, rev = split_revision(hub_id)
    patterns: List[str] = ["config.json", *TOKENIZER_FILES, *(WEIGHT_FILES if weights else [])]
    try:
        path = Path(snapshot_download(repo, revision=rev, allow_patterns=patterns))
    except hub_errors.GatedRepoError:
        raise MissingDataError(f"hub model {hub_id!r} is gated; accept its licence on huggingface.co and log in "
                               "(hf auth login or HF_TOKEN)") from None
    except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError):
        raise MissingDataError(f"hub model {hub_id!r} does not exist (or is private); check the id, or pass a local "
                               "checkpoint directory") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled) as err:
        if _offline():
            raise MissingDataError(f"hub model {hub_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 "
                                   "is set; download it once with a network (unset HF_HUB_OFFLINE), or point "
                                   "HF_HOME/HF_HUB_CACHE at a cache holding it") from None
        raise MissingDataError(f"hub model {hub_id!r} could not be fetched ({type(err).__name__}); check the "
                               "network, or pass a local checkpoint directory") from None
    except (OSError, hub_errors.HfHubHTTPError) as err:
        raise MissingDataError(f"hub model {hub_id!r} could not be fetched ({type(err).__name__}: "
                               f"{str(err).splitlines()[0][:160] if str(err) else ''}); check the network, or pass "
                               "a local checkpoint directory") from None
    if not (path / "config.json").is_file():
        raise MissingDataError(f"hub model {hub_id!r} has no config.json in {path}; it is not a transformers "
                               "checkpoint the engine can read")
    return path


def display_name(hub_id: str) -> str:
    """The model's name in run names and tables: the repo id with '/' as '--' (``owner--name``)."""
    repo, rev = split_revision(hub_id)
    return repo.replace("/", "--") + (f"@{rev}" if rev else "")
