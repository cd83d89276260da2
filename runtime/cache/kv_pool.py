"""Paged KV pool: K/V (or MLA latent) pages for the full-attention layers only.

1. Built from the LayerRegistry: for every full layer and every kv entry of its spec, one tensor
   [num_pages, page_size, *entry.shape]. Linear layers get nothing here.
2. `alloc(n)` hands out n page ids, each with one reference; `share(pages)` adds a reference to
   pages already handed out (a request reusing the prefix cache's pages, the cache keeping a
   request's pages); `free(pages)` drops one reference each, and a page with none left is free.
   Requests hold their page list; the prefix cache (runtime/cache/radix_cache.py) holds its own.
   `copy_pages(src, dst)` copies page contents (a request forked after a shared prompt).
3. Token i of a request lives at page_table[i // page_size], offset i % page_size.
4. `journal`: on rank 0 of a tensor-parallel run, a list recording page copies for the other
   ranks to replay (runtime/dist/distributed.py); None elsewhere.

A shared page is only ever read: pages are shared whole, and only full pages of tokens before a
request's first new token, so no request writes into a page another one reads.

It does not decide how many pages exist (the memory planner does) nor when a request may grow
(the engine does).
"""

from __future__ import annotations

import torch

from compiler.splitops import LayerRegistry, dtype_from_name

__all__ = ["KVPool", "OutOfPages", "pages_for"]


class OutOfPages(RuntimeError):
    pass


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens: the one statement of it (pools, planner, backends)."""
    return -(-num_tokens // page_size)


class KVPool:
    def __init__(self, registry: LayerRegistry, num_pages: int, page_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs at least one page of one token (got {num_pages} x {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # layer id -> entry name -> [num_pages, page_size, *shape]
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        for layer in registry.full_layers():
            self.buffers[layer.layer_id] = {
                name: torch.zeros((num_pages, page_size, *spec.shape),
                                  dtype=dtype or dtype_from_name(spec.dtype), device=self.device)
                for name, spec in layer.kv.items()
            }
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs: list[int] = [0] * num_pages  # holders of each page: requests and the prefix cache
        self.journal: list | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"KV pool: {n} pages asked, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of `pages`, which must be held already."""
        for p in pages:
            assert 0 <= p < self.num_pages and self._refs[p] > 0, f"KV pool: page {p} shared while free"
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody holds goes back to the free list."""
        released = []
        for p in pages:
            assert 0 <= p < self.num_pages and self._refs[p] > 0, f"KV pool: page {p} freed twice or unknown"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                released.append(p)
        self._free.extend(reversed(released))

    def holders(self, page: int) -> int:
        return self._refs[page]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages `src` onto pages `dst` in every layer (a request forked after its prefill
        gets its own copy, so each can write its next tokens into the last page)."""
        assert len(src) == len(dst), (src, dst)
        if not src:
            return
        if self.journal is not None:
            self.journal.append(("copy_pages", list(src), list(dst)))
        index_src = torch.tensor(src, device=self.device)
        index_dst = torch.tensor(dst, device=self.device)
        for entries in self.buffers.values():
            for t in entries.values():
                t[index_dst] = t[index_src]

    def layer(self, layer_id: int) -> dict[str, torch.Tensor]:
        try:
            return self.buffers[layer_id]
        except KeyError:
            raise KeyError(f"KV pool has no full-attention layer {layer_id} (layers: {sorted(self.buffers)})") from None

    def nbytes(self) -> int:
        return sum(t.nbytes for entries in self.buffers.values() for t in entries.values())
