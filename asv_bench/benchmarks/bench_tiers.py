"""The prefix store's byte tiers (issue 27): a restart hit of a 4k-token prefix (Llama-3.2-1B's
KV shape, 16 layers x 8 KV heads x 64, float16: 128 MiB) from the disk tier and from the Redis
tier, each beside its baseline (``np.fromfile`` of the same bytes; the redis client's ``GET``
of the same value). Targets (ratios, numbakv/tools/bench_tiers.py): >= 50% of the baseline."""

import os
import shutil
import tempfile

import numpy as np

from numbakv.tools import bench_tiers as bt

TOKENS = 4096


class DiskTier:
    timeout = 300

    def setup_cache(self):
        return bt.prefix_bytes(TOKENS)

    def setup(self, data):
        from numbakv.prefix.tiers import DiskTier as Tier
        self.root = tempfile.mkdtemp(prefix="nkv-asv-disk-")
        self.keys = bt._keys(TOKENS // 16)
        with Tier(bt.NAMESPACE, 4 * len(data), self.root) as tier:
            tier.write_run(self.keys[-1], self.keys, data)
        self.plain = os.path.join(self.root, "plain.bin")
        with open(self.plain, "wb") as f:
            f.write(data)
        self.tier = Tier(bt.NAMESPACE, 4 * len(data), self.root)
        self.nbytes = len(data)

    def teardown(self, data):
        self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def time_restart_hit(self, data):
        """find_blocks + read_runs on a freshly opened tier (a restarted process)."""
        from numbakv.prefix.tiers import DiskTier as Tier
        with Tier(bt.NAMESPACE, 4 * self.nbytes, self.root) as fresh:
            found = fresh.find_blocks(self.keys)
            fresh.read_runs([found[-1][0]])

    def time_np_fromfile_baseline(self, data):
        np.fromfile(self.plain, dtype=np.uint8)


class RedisTier:
    timeout = 300

    def setup_cache(self):
        return bt.prefix_bytes(TOKENS)

    def setup(self, data):
        try:
            import redis
        except ImportError:
            raise NotImplementedError("the redis client is not installed")
        try:
            self.server, url = bt._start_server()
        except RuntimeError as exc:
            raise NotImplementedError(str(exc))
        from numbakv.prefix.tiers import open_tier
        self.keys = bt._keys(TOKENS // 16)
        self.tier = open_tier(url, bt.NAMESPACE, 4 * len(data), timeout=10.0)
        self.tier.write_run(self.keys[-1], self.keys, data)
        self.raw = redis.Redis.from_url(url, socket_timeout=10.0)
        self.value_key = f"nkv:t1:{{{bt.NAMESPACE}}}:r:{self.keys[-1]}"

    def teardown(self, data):
        self.tier.close()
        self.raw.close()
        self.server.kill()
        self.server.wait(timeout=10)

    def time_hit(self, data):
        found = self.tier.find_blocks(self.keys)
        self.tier.read_runs([found[-1][0]])

    def time_client_get_baseline(self, data):
        self.raw.get(self.value_key)


class TierMoves:
    """Every tier's store and load *into the cache* against its floor (issue 36 item 6; the
    ratios, interleaved, are ``numbakv.tools.bench_tiers.bench_moves``): a 4k-token prompt (16
    layers x 8 x 64, float16: 128 MiB) saved by a ``PrefixStore`` whose only tier is host RAM
    or a disk directory (+ ``flush``), and loaded into an empty sequence. Floors: ``np.copyto``
    of the same bytes (host), write + fsync / ``np.fromfile`` (disk)."""

    params = ["host", "disk"]
    param_names = ["tier"]
    timeout = 300

    def setup(self, tier):
        import numbakv as nkv
        self.cache, self.prompt = bt._moves_cache(TOKENS, 16, 8, 64)
        n = self.cache.config.nbytes(TOKENS)
        self.root = tempfile.mkdtemp(prefix="nkv-asv-moves-")
        kw = dict(host_bytes=n + (1 << 20)) if tier == "host" else dict(
            disk_dir=self.root, disk_bytes=4 * n, model_id="asv/moves")
        self.store = nkv.PrefixStore(self.cache, **kw)
        self.salt = 0
        self.store.save(0, self.prompt, salt=b"load")
        self.store.flush()
        src = [self.cache.storage.keys[:, :TOKENS], self.cache.storage.values[:, :TOKENS]]
        self.src, self.dst = src, [np.ones_like(a) for a in src]
        self.blob = b"".join(bytes(a) for a in src)
        self.plain = os.path.join(self.root, "plain.bin")
        with open(self.plain, "wb") as f:
            f.write(self.blob)

    def teardown(self, tier):
        self.store.close()
        self.cache.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def time_store(self, tier):
        self.salt += 1
        self.store.save(0, self.prompt, salt=b"%d" % self.salt)
        self.store.flush()

    def time_load_into_cache(self, tier):
        self.store.load(1, self.prompt, salt=b"load")
        self.cache.seq_rm(1)

    def time_store_floor(self, tier):
        if tier == "host":
            for a, b in zip(self.src, self.dst):
                np.copyto(b, a)
            return
        fd = os.open(self.plain + ".w", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, self.blob)
            os.fsync(fd)
        finally:
            os.close(fd)

    def time_load_floor(self, tier):
        if tier == "host":
            for a, b in zip(self.src, self.dst):
                np.copyto(b, a)
            return
        np.fromfile(self.plain, dtype=np.uint8)
