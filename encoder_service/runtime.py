"""The vision encoder: only the vision tower (+ projector) of a checkpoint, through its family's face."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from encoder_service.cache import EncoderIdentity
from encoder_service.families.base import EncoderFace, PreparedItem
from encoder_service.lora import TowerLoras
from mmserve.checkpoint import load_config, load_weights, read_config, resolve_dtype
from mmserve.errors import InvalidRequest
from mmserve.families import face_class, family_of, router_face
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import EncodeItem, MediaItem, warm_up_image
from mmserve.lora import AdapterError

logger = logging.getLogger(__name__)


class WeightsFingerprint:
    """Hash of every tensor's checkpoint key, dtype, shape and bytes as stored, in the order
    read (stable across processes): fed by the loader (`on_read`), one tensor at a time."""

    def __init__(self):
        self._hash = hashlib.blake2b(digest_size=16)

    def __call__(self, key: str, tensor: torch.Tensor) -> None:
        self._hash.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        self._hash.update(tensor.detach().reshape(-1).view(torch.uint8).numpy().data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class VisionEncoder:
    """Loads the vision side of `model_dir` (only the tensors its face names) and encodes items.

    `forward(prepared)` runs one batch through the face and returns each item's output parts on
    CPU; `encode(items)` is preprocess + forward for callers without a pool. Thread-safe:
    forwards are serialised. An item under a LoRA adapter of the tower (`MediaItem.tower_adapter`)
    is encoded with it (`encoder_service.lora`; at most `max_loras` adapters kept read).
    """

    def __init__(self, model_dir: str | Path, dtype: str = "auto", device: str = "cpu", max_loras: int = 8):
        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.model_type = family_of(model_dir)
        self.dtype = resolve_dtype(dtype, read_config(model_dir))
        self.device = torch.device(device)
        config = load_config(model_dir)
        face = face_class("encoder_service.families", self.model_type, "ENCODER_FACE")
        self.face: EncoderFace = face(str(model_dir), config, self.dtype)
        self._router_face = None  # made on first `plan` (standalone server only)
        with torch.device(self.device):  # built where it runs, without initial values
            tower = self.face.build()
        fingerprint = WeightsFingerprint()
        self.load_report = load_weights(tower, model_dir, self.face.rename, convert=getattr(tower, "convert", None),
                                 on_read=fingerprint)
        self.tower = tower.to(self.device).eval().requires_grad_(False)
        self.keys_read = self.load_report.keys_read
        preprocess = hashlib.blake2b(self.face.preprocess_fingerprint().encode(), digest_size=16).hexdigest()
        self.identity = EncoderIdentity(self.model_dir.name, fingerprint.hexdigest(), preprocess, str(self.dtype))
        self.loras = TowerLoras(self.tower, self.face.rename, self.face.lora_stages, max_loras, self.dtype, self.device)
        self._lock = threading.Lock()
        logger.info("vision tower of %s loaded: %s; %.1fM params, %s on %s, %.1fs in all", self.model_dir.name,
                    self.load_report.summary(), self.num_parameters / 1e6, self.dtype, self.device,
                    time.perf_counter() - start)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.tower.parameters())

    def plan(self, item: MediaItem, max_pixels: int = 1 << 62) -> EncodeItem:
        """What a router would send for `item` (for callers that get bare items: the gRPC server)."""
        if self._router_face is None:
            self._router_face = router_face(self.model_dir)
        expansion = self._router_face.expand(item, max_pixels)
        return EncodeItem(item, expansion.layout, expansion.cost)

    def preprocess(self, item: EncodeItem) -> PreparedItem:
        """The face's prepared item, with its tower adapter (read here: InvalidRequest when it does
        not fit, failing only this item)."""
        prepared = self.face.preprocess(item.item, item.layout)
        if (ref := item.item.tower_adapter) is None:
            return prepared
        try:
            self.loras.get(ref)
        except AdapterError as e:
            raise InvalidRequest(str(e)) from None
        return dataclasses.replace(prepared, lora=ref)

    def split(self, prepared: PreparedItem, budget: int, unit: str) -> list[PreparedItem]:
        return [dataclasses.replace(piece, lora=prepared.lora) for piece in self.face.split(prepared, budget, unit)]

    def capture_graphs(self, max_cost: int, unit: str, capture: bool = True, max_patches: int | None = None) -> str:
        """CUDA graphs of the tower per budget up to the pool's `max_cost` and `max_patches` where the
        face has them (`capture=False`: the same padded forwards, uncaptured); returns and logs what
        happened. A batch over the largest budget runs eager."""
        with self._lock:
            what = self.face.capture_graphs(self.tower, max_cost, unit, capture, max_patches)
        logger.info("encoder graphs of %s: %s", self.model_dir.name, what)
        return what

    @torch.inference_mode()
    def forward(self, prepared: Sequence[PreparedItem]) -> list[tuple[torch.Tensor, ...]]:
        """One forward over `prepared`; each item's output parts, on CPU."""
        if not prepared:
            return []
        with self._lock:
            if all(p.lora is None for p in prepared):
                outs = self.face.forward(self.tower, prepared)
            else:
                with self.loras.step([p.lora for p in prepared], self.face.lora_rows(prepared)):
                    outs = self.face.forward(self.tower, prepared)
        return [tuple(part.to("cpu") for part in parts) for parts in outs]

    def warm_up(self) -> None:
        """Encode one small synthetic image (decode, the processor, one forward) before serving, so
        that the first request finds them warm; nothing is kept (no pool, no cache here)."""
        start = time.perf_counter()
        self.encode([warm_up_image()])
        logger.info("vision tower of %s warmed up in %.2fs", self.model_dir.name, time.perf_counter() - start)

    def encode(self, items: Sequence[EncodeItem | MediaItem]) -> list[ItemEmbedding]:
        items = [i if isinstance(i, EncodeItem) else self.plan(i) for i in items]
        outs = self.forward([self.preprocess(item) for item in items])
        return [ItemEmbedding(parts, self.identity.key(item.item)) for item, parts in zip(items, outs)]
