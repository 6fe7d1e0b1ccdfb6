"""The piece schedule of the ring backward: how finely each chunk's keys/values are cut, and where a piece lies.

Ring attention and ``seqpar bench cuda`` cut the same way, so the benchmark times what training runs.
"""

from __future__ import annotations

import torch

BACKWARD_PIECES = 8  # per chunk; chunks that do not divide, or would give short pieces, take 2, then 1
# The shortest piece worth its extra kernel calls and ring passes (Note [ring backward]).
MIN_PIECE_TOKENS = {"cpu": 256, "cuda": 16384}


def pieces_per_chunk(chunk: int, device_type: str) -> int:
    """How many pieces each chunk's K/V is cut into for the ring backward (Note [ring backward]).

    Args:
        chunk: tokens per chunk.
        device_type: "cpu", "cuda", ...; unknown types are treated as "cuda".

    Returns:
        ``BACKWARD_PIECES``, 2 or 1: the most pieces that divide the chunk and are not too short.
    """
    shortest = MIN_PIECE_TOKENS.get(device_type, MIN_PIECE_TOKENS["cuda"])
    for pieces in (BACKWARD_PIECES, 2):
        if chunk % pieces == 0 and chunk // pieces >= shortest:
            return pieces
    return 1


def piece_ids(chunk_ids: tuple[int, ...], pieces: int) -> list[int]:
    """Global ids of the pieces of ``chunk_ids`` when every chunk is cut into ``pieces`` (local order kept).

    Args:
        chunk_ids: global chunk ids, in local order.
        pieces: pieces per chunk.

    Returns:
        ``pieces`` ids per chunk, chunk after chunk.
    """
    return [c * pieces + i for c in chunk_ids for i in range(pieces)]


def _pieced(x: torch.Tensor, chunks: int, pieces: int) -> torch.Tensor:
    """``x`` ``[B, H, S, D]`` viewed as ``[B, H, chunks, pieces, S / (chunks * pieces), D]``."""
    b, h, s, d = x.shape
    return x.reshape(b, h, chunks, pieces, s // (chunks * pieces), d)


def take_piece(x: torch.Tensor, chunks: int, pieces: int, j: int) -> torch.Tensor:
    """Piece ``j`` of each of the ``chunks`` local chunks of ``x`` ``[B, H, S, D]``, one after another.

    Args:
        x: local tensor made of ``chunks`` equal chunks.
        chunks: chunks in ``x``.
        pieces: pieces per chunk.
        j: which piece of every chunk.

    Returns:
        ``[B, H, S / pieces, D]``.
    """
    b, h, s, d = x.shape
    return _pieced(x, chunks, pieces)[:, :, :, j].reshape(b, h, s // pieces, d)


def put_piece(x: torch.Tensor, chunks: int, pieces: int, j: int, value: torch.Tensor) -> None:
    """Write ``value`` (shaped like ``take_piece``'s result) into piece ``j`` of every chunk of ``x``, in place.

    Args:
        x: contiguous local tensor ``[B, H, S, D]`` made of ``chunks`` equal chunks.
        chunks: chunks in ``x``.
        pieces: pieces per chunk.
        j: which piece of every chunk.
        value: ``[B, H, S / pieces, D]``.
    """
    b, h, s, d = x.shape
    _pieced(x, chunks, pieces)[:, :, :, j] = value.view(b, h, chunks, s // (chunks * pieces), d)
