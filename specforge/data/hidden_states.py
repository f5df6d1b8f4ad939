"""The offline hidden-state store: sharded safetensors files plus a JSON manifest.

A capture directory holds::

    manifest.json              what was captured (target fingerprint, aux layers, dtype, ...)
                               and, per shard, its sample ids, token count, bytes and sha256
    shard-00000.safetensors    samples, concatenated along the token axis
    shard-00000.json           that shard's manifest entry, written right after the shard

One shard file holds, for its ``S`` samples with ``N`` tokens in all::

    input_ids          (N,) int32         token ids
    loss_mask          (N,) bool          assistant tokens
    offsets            (S + 1,) int64     sample i is tokens [offsets[i], offsets[i + 1])
    aux_hidden_states  (N, 3 * H)         the three aux layers, every token
    last_hidden_state  (M, H)             after the final norm, only where the loss reads it
    last_offsets       (S + 1,) int64     sample i's rows of last_hidden_state

The TTT loss scores the draft's prediction of token ``p + 1`` against the target's distribution
at position ``p`` only where ``loss_mask[p + 1]`` holds (:mod:`specforge.trainer.ttt`), so the
last hidden state is stored at exactly those positions (:func:`last_hidden_positions`). Bytes per
token: ``4 + 1 + 3 * H * b + f * H * b`` for ``b`` bytes per element and a fraction ``f`` of
positions under the shifted loss mask, against ``8 * H * b``-ish layouts that store aux and last
hidden states for every token.

Safety: every file is written to a temp file and renamed; a shard counts as complete only when
its entry file exists and matches the plan and the shard's size, so a rerun after a kill redoes
exactly the incomplete shards. Shards are planned deterministically from the samples (sorted by
length, filled to ``shard_bytes``), so rank ``r`` of ``W`` owns shards ``r, r + W, ...`` and any
rerun, with any number of ranks, writes the same files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from specforge.config.resolve import torch_dtype
from specforge.data.chat import TokenizedSample, scored_positions
from specforge.errors import UserError
from specforge.io import file_problem, file_sha256, write_bytes_atomic, write_json_atomic

FORMAT = "specforge-hidden-states"
VERSION = 1
MANIFEST = "manifest.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def entry_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def last_hidden_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """(T,) bool: positions ``p`` whose last hidden state the loss reads (``loss_mask[p + 1]``)."""
    # (T,) -> (1, T) -> (T,)
    return scored_positions(loss_mask[None])[0]


def sample_bytes(num_tokens: int, num_last: int, *, hidden_size: int, itemsize: int) -> int:
    """Bytes one sample takes in a shard (tensor data; the header is a few KB per shard)."""
    per_token = 4 + 1 + 3 * hidden_size * itemsize
    return num_tokens * per_token + num_last * hidden_size * itemsize + 2 * 8


@dataclass
class CapturePlan:
    """Which samples go in which shard, and everything that fixes the shards' content."""

    header: dict[str, Any]
    """The manifest fields that describe the capture as a whole (target, aux layers, dtype...)."""
    shards: list[list[int]]
    """Per shard, indices into the sample list, longest first."""
    shard_bytes: list[int]
    """Per shard, the exact bytes of its tensor data."""

    def plan_hash(self, index: int, sample_ids: list[str]) -> str:
        """Identity of shard ``index``: the header plus the ids it holds."""
        text = json.dumps(
            {"header": self.header, "index": index, "ids": sample_ids}, sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()


def plan_shards(
    samples: list[TokenizedSample],
    *,
    header: dict[str, Any],
    hidden_size: int,
    itemsize: int,
    shard_bytes: int,
) -> CapturePlan:
    """Sort samples by length (longest first, ties by id) and fill shards up to ``shard_bytes``.

    Raises:
        UserError: no samples.
    """
    if not samples:
        raise UserError("nothing to capture: no sample has assistant tokens")
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].input_ids), samples[i].id))
    shards: list[list[int]] = []
    sizes: list[int] = []
    for i in order:
        sample = samples[i]
        size = sample_bytes(
            len(sample.input_ids),
            int(last_hidden_positions(sample.loss_mask).sum()),
            hidden_size=hidden_size,
            itemsize=itemsize,
        )
        if not shards or (sizes[-1] + size > shard_bytes and shards[-1]):
            shards.append([])
            sizes.append(0)
        shards[-1].append(i)
        sizes[-1] += size
    return CapturePlan(header=header, shards=shards, shard_bytes=sizes)


def forward_batches(lengths: list[int], *, batch_tokens: int, max_batch_size: int) -> list[range]:
    """Group consecutive samples (sorted longest first) into batches of at most
    ``batch_tokens`` padded tokens and ``max_batch_size`` samples."""
    batches: list[range] = []
    start = 0
    while start < len(lengths):
        end = start + 1
        while (
            end < len(lengths)
            and end - start < max_batch_size
            and lengths[start] * (end + 1 - start) <= batch_tokens
        ):
            end += 1
        batches.append(range(start, end))
        start = end
    return batches


# ---------------------------------------------------------------------------------------------
# Writing


def encode_shard(
    samples: list[TokenizedSample],
    aux_hidden_states: list[torch.Tensor],
    last_hidden_states: list[torch.Tensor],
) -> bytes:
    """Serialize one shard. ``aux_hidden_states[i]`` is (T_i, 3H); ``last_hidden_states[i]`` is
    (T_i, H) and only the rows at :func:`last_hidden_positions` are kept."""
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    needed = [last_hidden_positions(s.loss_mask) for s in samples]
    last_counts = torch.tensor([int(n.sum()) for n in needed])
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask.bool() for s in samples]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        # S x (T_i, 3H) -> (N, 3H)
        "aux_hidden_states": torch.cat(aux_hidden_states).contiguous(),
        # S x (T_i, H)[needed_i] -> (M, H)
        "last_hidden_state": torch.cat(
            [h[n] for h, n in zip(last_hidden_states, needed, strict=True)]
        ).contiguous(),
        "last_offsets": torch.cat([torch.zeros(1, dtype=torch.long), last_counts.cumsum(0)]),
    }
    # one metadata key: safetensors writes several in hash order, which would make the bytes
    # (and the checksum) differ between identical captures
    return save(tensors, metadata={"format": f"{FORMAT}/{VERSION}"})


def write_shard(
    directory: Path,
    index: int,
    payload: bytes,
    *,
    samples: list[TokenizedSample],
    plan_hash: str,
) -> dict[str, Any]:
    """Write shard ``index`` and then its manifest entry, each atomically; return the entry."""
    write_bytes_atomic(directory / shard_name(index), payload)
    entry = {
        "file": shard_name(index),
        "sample_ids": [s.id for s in samples],
        "num_samples": len(samples),
        "num_tokens": sum(len(s.input_ids) for s in samples),
        "num_last_positions": sum(int(last_hidden_positions(s.loss_mask).sum()) for s in samples),
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "plan_hash": plan_hash,
    }
    write_json_atomic(directory / entry_name(index), entry)
    return entry


def complete_entry(directory: Path, index: int, plan_hash: str) -> dict[str, Any] | None:
    """Shard ``index``'s entry if the shard is complete for this plan, else ``None``.

    Raises:
        UserError: the directory holds this shard from a different capture (other data,
            target or settings): mixing them would corrupt the dataset.
    """
    entry_path = directory / entry_name(index)
    shard_path = directory / shard_name(index)
    if not entry_path.is_file():
        return None
    entry = json.loads(entry_path.read_text())
    if entry.get("plan_hash") != plan_hash:
        raise UserError(
            f"{directory} already holds {shard_name(index)} from a different capture (other "
            "data, target, aux layers, dtype or shard size); capture into a new directory"
        )
    if not shard_path.is_file() or shard_path.stat().st_size != entry["bytes"]:
        return None
    if file_sha256(shard_path) != entry["sha256"]:  # corrupted since: redo it
        return None
    return entry


def remove_temp_files(directory: Path) -> int:
    """Delete leftovers of interrupted atomic writes (``.<name>.*.tmp``); return how many."""
    removed = 0
    for tmp in directory.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        removed += 1
    return removed


def check_disk_space(directory: Path, needed_bytes: int) -> None:
    """Refuse to start when the file system cannot hold ``needed_bytes`` more (plus 5%).

    Raises:
        UserError: not enough free space; the message gives both figures.
    """
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed_bytes * 1.05 > free:
        raise UserError(
            f"capture needs about {needed_bytes / 2**30:.2f} GiB more in {directory}, but only "
            f"{free / 2**30:.2f} GiB are free; free space, use capture.output elsewhere, or "
            "capture fewer samples (data.limit / data.max_length)"
        )


def write_manifest(directory: Path, plan: CapturePlan, entries: list[dict[str, Any]]) -> Path:
    """Merge the shard entries into ``manifest.json`` (atomically)."""
    tokens = sum(e["num_tokens"] for e in entries)
    total_bytes = sum(e["bytes"] for e in entries)
    manifest = {
        **plan.header,
        "num_samples": sum(e["num_samples"] for e in entries),
        "num_tokens": tokens,
        "num_last_positions": sum(e["num_last_positions"] for e in entries),
        "bytes": total_bytes,
        "bytes_per_token": round(total_bytes / max(tokens, 1), 2),
        "shards": entries,
    }
    path = directory / MANIFEST
    write_json_atomic(path, manifest)
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a finished capture.

    Raises:
        UserError: no manifest (the capture never finished: rerun the same command).
        UserError: not a specforge capture, a newer format, or a damaged file.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"{path} not found: the capture is missing or unfinished (rerun `specforge capture` "
            "with the same settings; it resumes)"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:  # a truncated or hand-edited file
        raise UserError(
            f"{path} is not valid JSON ({err}): the capture's manifest is damaged (rerun "
            "`specforge capture` with the same settings into a new directory)"
        ) from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: a manifest is a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(
            f"{path}: not a {FORMAT} v{VERSION} manifest "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})"
        )
    for index, entry in enumerate(manifest.get("shards", [])):
        if entry.get("file") != shard_name(index):  # never a path outside the directory
            raise UserError(
                f"{path}: shard {index} is listed as {entry.get('file')!r}, expected "
                f"{shard_name(index)!r} (a manifest names only its own directory's shards)"
            )
    return manifest


def check_shard(directory: Path, entry: dict[str, Any]) -> None:
    """Refuse a shard whose size or sha256 is not the manifest's.

    Raises:
        UserError: naming the file (a truncated or corrupted shard; rerun the capture).
    """
    path = directory / entry["file"]
    problem = file_problem(path, entry["sha256"], entry["bytes"])
    if problem is not None:
        raise UserError(
            f"{path} {problem}: rerun `specforge capture` with the same settings to redo it"
        )


def check_manifest_matches(manifest: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Refuse a capture made for another target, tokenizer or aux layers.

    Args:
        manifest: a capture's manifest.
        expected: dotted manifest keys (``target.config_hash``) and the values this run needs.
        where: the capture directory, for the message.

    Raises:
        UserError: naming every field that differs, with both values.
    """

    def lookup(key: str) -> Any:
        node: Any = manifest
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    diffs = [
        f"{key}: captured {lookup(key)!r}, given {value!r}"
        for key, value in expected.items()
        if lookup(key) != value
    ]
    if diffs:
        raise UserError(
            f"the capture in {where} was made for another target or settings: "
            + "; ".join(diffs)
            + " (capture again with this target, or train with the one captured)"
        )


def verify_capture(directory: str | Path) -> list[str]:
    """Re-check every shard of a capture: presence, size, sha256, tensor shapes and dtypes.

    Returns:
        The problems found (empty when the capture is sound).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    hidden = manifest["target"]["hidden_size"]
    dtype = torch_dtype(manifest["dtype"])
    problems = []
    for entry in manifest["shards"]:
        path = directory / entry["file"]
        if not path.is_file():
            problems.append(f"{entry['file']}: missing")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{entry['file']}: {size} bytes, manifest says {entry['bytes']}")
            continue
        if file_sha256(path) != entry["sha256"]:
            problems.append(f"{entry['file']}: sha256 differs from the manifest")
            continue
        problems += [
            f"{entry['file']}: {p}" for p in _shard_shape_problems(path, entry, hidden, dtype)
        ]
    return problems


def _shard_shape_problems(path: Path, entry: dict, hidden: int, dtype: torch.dtype) -> list[str]:
    with safe_open(path, framework="pt") as f:
        t = {name: f.get_tensor(name) for name in f.keys()}
    n, s = entry["num_tokens"], entry["num_samples"]
    expected = {
        "input_ids": ((n,), torch.int32),
        "loss_mask": ((n,), torch.bool),
        "offsets": ((s + 1,), torch.int64),
        "aux_hidden_states": ((n, 3 * hidden), dtype),
        "last_hidden_state": ((entry["num_last_positions"], hidden), dtype),
        "last_offsets": ((s + 1,), torch.int64),
    }
    problems = [
        f"{name}: {tuple(t[name].shape)} {t[name].dtype}, expected {shape} {dt}"
        for name, (shape, dt) in expected.items()
        if name not in t or tuple(t[name].shape) != shape or t[name].dtype != dt
    ]
    if problems:
        return problems
    needed = sum(
        int(last_hidden_positions(t["loss_mask"][a:b]).sum())
        for a, b in zip(t["offsets"][:-1].tolist(), t["offsets"][1:].tolist(), strict=True)
    )
    if int(t["offsets"][-1]) != n or needed != entry["num_last_positions"]:
        problems.append("offsets or stored last-hidden positions disagree with the loss mask")
    return problems


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class StoredSample:
    """Where one captured sample lives."""

    shard: int
    tokens: tuple[int, int]
    """Its rows in the shard's token-axis tensors."""
    last_rows: tuple[int, int]
    """Its rows of ``last_hidden_state``."""


class HiddenStateStore:
    """Read a capture: token ids and loss masks of every sample, hidden states on demand.

    Tensors are read through ``safe_open`` slices (memory-mapped), one sample at a time; the
    file handles are opened lazily, so a store can be handed to DataLoader workers.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.hidden_size = self.manifest["target"]["hidden_size"]
        self.locations: dict[str, StoredSample] = {}
        self._handles: dict[int, Any] = {}

    def samples(self) -> list[TokenizedSample]:
        """Every captured sample's ids and loss mask, in manifest order. Each shard's size and
        sha256 are checked here, once per run (DataLoader workers inherit the checked store).

        Raises:
            UserError: a shard that is missing, truncated or corrupted, named.
        """
        samples = []
        for index, entry in enumerate(self.manifest["shards"]):
            check_shard(self.directory, entry)
            with safe_open(self.directory / entry["file"], framework="pt") as f:
                ids = f.get_tensor("input_ids").long()
                mask = f.get_tensor("loss_mask")
                offsets = f.get_tensor("offsets").tolist()
                last = f.get_tensor("last_offsets").tolist()
            for i, sample_id in enumerate(entry["sample_ids"]):
                a, b = offsets[i], offsets[i + 1]
                samples.append(TokenizedSample(sample_id, ids[a:b].clone(), mask[a:b].clone()))
                self.locations[sample_id] = StoredSample(index, (a, b), (last[i], last[i + 1]))
        return samples

    def _handle(self, shard: int):
        if shard not in self._handles:
            path = self.directory / self.manifest["shards"][shard]["file"]
            self._handles[shard] = safe_open(path, framework="pt")
        return self._handles[shard]

    def hidden_states(self, sample: TokenizedSample) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux (T, 3H), last (T, H))`` of one sample; ``last`` is zero where not stored.

        Call :meth:`samples` first (it builds the index).
        """
        where = self.locations[sample.id]
        f = self._handle(where.shard)
        aux = f.get_slice("aux_hidden_states")[where.tokens[0] : where.tokens[1]]
        rows = f.get_slice("last_hidden_state")[where.last_rows[0] : where.last_rows[1]]
        last = torch.zeros(len(sample.input_ids), self.hidden_size, dtype=rows.dtype)
        last[last_hidden_positions(sample.loss_mask)] = rows
        return aux, last

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}
