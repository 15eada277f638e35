"""The encoder stage's logic without its process: a request's images in, where their embeddings
are in the shared-memory cache out (docs/architecture.md "Images")."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from ipc import messages as m
from ipc.embedding_cache import EmbeddingCache, NoRoom
from services.common.images import ImageError, ImageRules, open_image, pixels_key
from services.encoder.qwen2_vl import Qwen2VLVisionEncoder
from services.encoder.vision import VisionEncoder


class EncoderCore:
    """Decodes each image within `max_image_pixels`, cuts it into the tiles the model's rules
    make (resized and normalized), and runs the vision tower on the tiles the cache lacks, those
    of one request and one size in one batch (Qwen2.5-VL's tiles take their images' sizes). Each
    tile is cached by the content of its pixels, so a tile already cached costs its image's
    decode only. A request's tiles must fit the cache together (each takes the pages its tokens
    need): putting one never evicts another of the same request, and where the request's cached
    tiles are in the way of its new ones, those move rather than other requests' images go."""

    def __init__(
        self,
        vision: VisionEncoder | Qwen2VLVisionEncoder,
        rules: ImageRules,
        cache: EmbeddingCache,
        max_image_pixels: int,
    ) -> None:
        self.vision = vision
        self.rules = rules
        self.cache = cache
        self.max_image_pixels = max_image_pixels
        self.num_encoded = 0  # tiles run through the tower
        self.num_cached = 0  # tiles the cache had

    def encode(self, request: m.EncodeImages) -> m.ImagesEncoded:
        """The keys and cache refs of the request's tiles, image after image, in prompt order."""
        tiles: list[np.ndarray] = []
        for i, data in enumerate(request.images):
            try:
                tiles += self.rules.tiles(open_image(data, self.max_image_pixels))
            except ImageError as exc:
                return m.ImagesEncoded(request.request_id, error=f"images[{i}]: {exc}")
        keys = [pixels_key(pixels) for pixels in tiles]
        rows = {key: self.rules.pixels_tokens(pixels) for key, pixels in zip(keys, tiles, strict=True)}
        num_pages = sum(self.cache.pages_of(n) for n in rows.values())
        if num_pages > self.cache.num_pages:
            return m.ImagesEncoded(
                request.request_id,
                error=f"{len(request.images)} images of {len(tiles)} tiles take {num_pages} pages of "
                f"{self.cache.page_rows} image tokens; this encoder's cache holds {self.cache.num_pages} "
                "(encoder.cache_bytes)",
            )
        new = {key: pixels for key, pixels in zip(keys, tiles, strict=True) if self.cache.find(key) is None}
        encoded: dict[bytes, np.ndarray] = {}
        for shape in {pixels.shape for pixels in new.values()}:
            batch = {key: pixels for key, pixels in new.items() if pixels.shape == shape}
            embeddings = self.vision.encode(torch.from_numpy(np.stack(list(batch.values()))))
            encoded.update(zip(batch, embeddings.numpy(), strict=True))
        # No tile of this request evicts another (keep). Dry run first: a put that finds no room
        # has evicted every other image on the way.
        if self.cache.fits([len(embeddings) for embeddings in encoded.values()], keep=rows.keys()):
            for key, embeddings in encoded.items():
                self.cache.put(key, embeddings, keep=rows.keys())
        else:
            self._repack([key for key in rows if key not in encoded], encoded, keep=rows.keys())
        self.num_encoded += len(new)
        self.num_cached += len(keys) - len(new)
        refs = [self.cache.find(key) for key in keys]
        return m.ImagesEncoded(request.request_id, keys=keys, refs=refs)  # type: ignore[arg-type]

    def _repack(self, cached: list[bytes], encoded: dict[bytes, np.ndarray], keep: Collection[bytes]) -> None:
        """Put a request's tiles that fit the cache together but not around its `cached` ones'
        pages: those move (their rows copied out, their pages freed; an earlier request's ref to
        them reads None and its reader asks again, a round trip, not an encode), and all go in
        largest first, evicting other requests' least recently used images only as needed."""
        for key in cached:
            ref = self.cache.find(key)
            embeddings = self.cache.read(ref, key) if ref is not None else None
            assert embeddings is not None  # kept, and this process is the only writer
            encoded[key] = embeddings
            self.cache.evict(key)
        largest_first = sorted(encoded.items(), key=lambda item: len(item[1]), reverse=True)
        try:
            for key, embeddings in largest_first:
                self.cache.put(key, embeddings, keep=keep)
        except NoRoom:
            # Still possible: a put evicts only until some run is long enough, wherever it lies,
            # so a tile put earlier can split the pages a later one needs (12 pages, a tile of 8
            # put at page 2 leaves runs of 2 for one of 3). By then every other image is evicted
            # (NoRoom), so this drops only the request's own tiles, and puts into an empty cache
            # pack them from its first page, which their pages (at most the cache's) fit.
            self.cache.clear()
            for key, embeddings in largest_first:
                self.cache.put(key, embeddings)
