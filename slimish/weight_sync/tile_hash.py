"""SGLang's checksum of a tensor on a GPU (`sglang.kernels.ops.memory.gpu_tensor_hash`, what `/weights_checker`
reports for every parameter of a CUDA engine), in torch on any device, and computable from parts of the tensor
hashed apart.

SGLang's kernel views the tensor's bytes as little-endian uint32 words (zero-padded to a whole word), n of them,
and cuts them into tiles of 8192 words (32 KiB). Per tile it sums, mod 2^32, two per-word hashes of the word's value
and its global index (h1, h2), xors each with the padded byte count 4n (mod 2^32), mixes each (fmix32) and makes
one 64-bit partial, h1 << 32 | h2; the partials are summed mod 2^64 and the sum mixed once more (splitmix64).
So everything but the last two steps adds up: a byte range of the tensor, hashed where it lies, knowing only its
byte offset, gives each tile it touches its share of (h1, h2), and those shares add across ranges (`TileHash`); a
word split between two ranges is hashed once both halves are known, at `finalize`. tests/weight_sync/
test_tile_hash.py proves it bit-equal to SGLang's kernel (run under the Triton interpreter on the CPU), and
tests/gpu/test_tile_hash_gpu.py to the kernel on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TILE_WORDS = 8192  # SGLang's tile_words default, which /weights_checker uses
SEED = 0x243F6A88  # SGLang's seed default
SEED1 = SEED & 0xFFFFFFFF
SEED2 = ((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
POS_A, POS_B = 0x27D4EB2D, 0x165667B1
MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
# Words hashed per step: bounds the temporaries (a few times 4 bytes per word) for a large parameter.
CHUNK_WORDS = 1 << 20


# The arithmetic is SGLang's in uint32, done in int32 (torch lacks most uint32 kernels): multiplication, addition and
# left shifts wrap mod 2^32 alike in two's complement, and right shifts are made logical by masking the sign's copies.
def _signed(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


def _shr(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x >> r) & ((1 << (32 - r)) - 1)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 16)
    x = x * _signed(FMIX_C1)
    x = x ^ _shr(x, 13)
    x = x * _signed(FMIX_C2)
    return x ^ _shr(x, 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x << r) | _shr(x, 32 - r)


def _word_hashes(words: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's two per-word hashes (k1, k2) of `words` at global word indices `index` (both int32 holding
    uint32 bits; the index mod 2^32, as the kernel's)."""
    p1 = (index * _signed(POS_A) + _signed(SEED1)) ^ _rotl32(index, 15)
    p2 = (index * _signed(POS_B) + _signed(SEED2)) ^ _rotl32(index, 13)
    return _fmix32(words ^ p1), _fmix32(words ^ p2)


def _words_of(data: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 words of `data` (uint8, a multiple of 4 long), as int32."""
    data = data.contiguous()
    if data.storage_offset() % 4:
        data = data.clone()
    return data.view(torch.int32)


def _index(first: int, count: int, device: torch.device) -> torch.Tensor:
    """Word indices first..first+count-1 mod 2^32, as int32 bits."""
    return (torch.arange(first, first + count, dtype=torch.int64, device=device) & MASK32).to(torch.int32)


def _tile_sums(k: torch.Tensor, first: int) -> torch.Tensor:
    """Per tile touched, the sum (int64, not yet reduced mod 2^32) of `k`, words from global word index `first`."""
    head = min(k.numel(), -first % TILE_WORDS)
    body = (k.numel() - head) // TILE_WORDS * TILE_WORDS
    parts = [k[:head].sum(dtype=torch.int64).reshape(1)] if head else []
    if body:
        parts.append(k[head:head + body].reshape(-1, TILE_WORDS).sum(dim=1, dtype=torch.int64))
    if head + body < k.numel():
        parts.append(k[head + body:].sum(dtype=torch.int64).reshape(1))
    return torch.cat(parts)


@dataclass
class TileHash:
    """The hash state of one tensor of `total` bytes (None: not known yet) from the byte ranges added so far.

    `add(data, offset)` hashes a range where `data` lies (any device); `merge` adds another's state (another part
    of the same tensor hashed elsewhere: it pickles small, a few ints per tile touched); `finalize()` is SGLang's
    hex checksum once every byte has been added (`complete`). Contract: the ranges added, over every state merged,
    do not overlap."""
    total: int | None = None
    covered: int = 0
    # (first tile, int64 [k, 2] raw (h1, h2) sums mod 2^32 of tiles first..first+k-1), on the CPU
    tiles: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    loose: dict[int, int] = field(default_factory=dict)  # word index -> its bytes known so far (a split word)

    @property
    def complete(self) -> bool:
        return self.total is not None and self.covered == self.total

    def add(self, data: torch.Tensor, offset: int) -> TileHash:
        """Hash `data`'s bytes (any dtype, contiguous or not) as the ones at byte `offset` of the tensor."""
        data = data.detach().contiguous().reshape(-1).view(torch.uint8)
        nbytes = data.numel()
        if nbytes == 0:
            return self
        self.covered += nbytes
        first_word, end = -(-offset // 4), offset + nbytes
        last_word = end // 4  # words [first_word, last_word) lie whole in the range
        for byte in range(offset, min(end, 4 * first_word)):  # a word begun before the range
            self._loose(byte, int(data[byte - offset]))
        if last_word < first_word:  # the range lies inside one word, begun above
            return self
        for byte in range(max(4 * last_word, 4 * first_word), end):  # a word ending after the range
            self._loose(byte, int(data[byte - offset]))
        whole = data[4 * first_word - offset:4 * last_word - offset]
        for start in range(0, last_word - first_word, CHUNK_WORDS):
            stop = min(start + CHUNK_WORDS, last_word - first_word)
            self._add_words(_words_of(whole[4 * start:4 * stop]), first_word + start)
        return self

    def _loose(self, byte: int, value: int) -> None:
        word = byte // 4
        self.loose[word] = self.loose.get(word, 0) | (value << (8 * (byte % 4)))

    def _add_words(self, words: torch.Tensor, first: int) -> None:
        """Whole words `words` (int32) at global word index `first`: each tile's share of (h1, h2)."""
        k1, k2 = _word_hashes(words, _index(first, words.numel(), words.device))
        sums = torch.stack([_tile_sums(k1, first), _tile_sums(k2, first)], dim=1)
        self.tiles.append((first // TILE_WORDS, (sums & MASK32).cpu()))

    def merge(self, other: TileHash) -> TileHash:
        """Add `other`'s ranges (of the same tensor) to this state."""
        if other.total is not None and self.total is not None and other.total != self.total:
            raise ValueError(f"merging the hash states of tensors of {self.total} and {other.total} bytes")
        self.total = self.total if self.total is not None else other.total
        self.covered += other.covered
        self.tiles += other.tiles
        for word, value in other.loose.items():
            self.loose[word] = self.loose.get(word, 0) | value  # disjoint bytes of one word
        return self

    def finalize(self) -> str:
        """SGLang's checksum (16 hex digits) of the whole tensor; raises unless every byte was added."""
        if self.total is None:
            self.total = self.covered
        if not self.complete:
            raise ValueError(f"hash of a tensor of {self.total} bytes given {self.covered} of them")
        n = -(-self.total // 4)
        if n == 0:
            return f"{0:016x}"
        count = -(-n // TILE_WORDS)
        sums = torch.zeros(count, 2, dtype=torch.int64, device="cpu")
        for first, part in self.tiles:
            sums[first:first + len(part)] += part
        if self.loose:
            words = sorted(self.loose)
            values = torch.tensor([self.loose[w] for w in words], dtype=torch.int64, device="cpu").to(torch.int32)
            index = torch.tensor(words, dtype=torch.int64, device="cpu")
            k1, k2 = _word_hashes(values, (index & MASK32).to(torch.int32))
            tile = index // TILE_WORDS
            sums[:, 0].index_add_(0, tile, k1.to(torch.int64))
            sums[:, 1].index_add_(0, tile, k2.to(torch.int64))
        h = _fmix32(((sums & MASK32) ^ ((4 * n) & MASK32)).to(torch.int32)).to(torch.int64) & MASK32
        # sum of (h1 << 32 | h2) mod 2^64: both column sums fit int64 (under 2^31 tiles of under 2^32 each)
        total = ((int(h[:, 0].sum()) << 32) + int(h[:, 1].sum())) & MASK64
        return f"{_splitmix64(total):016x}"


def _splitmix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def tile_hash(tensor: torch.Tensor) -> str:
    """SGLang's checksum of `tensor` as a CUDA engine reports it, on the tensor's own device."""
    nbytes = tensor.numel() * tensor.element_size()
    return TileHash(total=nbytes).add(tensor, 0).finalize()
