//! On-disk cache of compiled kernels (cubins). Key: hash of the exact source and options, the
//! architecture and the NVRTC version. An entry carries its key and a checksum of its payload;
//! anything that does not match (truncated write, bit rot, another version) is rebuilt, never
//! trusted. Writes go to a temporary file that is renamed into place, so readers never see half
//! an entry.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

const MAGIC: &[u8; 12] = b"LILY-CUBIN1\n";

/// FNV-1a, 64-bit: stable across Rust versions and platforms (std's hasher is not).
pub fn fnv64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are kept: `LILY_CACHE_DIR`, else `$XDG_CACHE_HOME/lily`, else
/// `~/.cache/lily`; always a `cuda` folder inside.
pub fn default_dir() -> Option<PathBuf> {
    let base = if let Some(d) = std::env::var_os("LILY_CACHE_DIR") {
        PathBuf::from(d)
    } else if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        PathBuf::from(d).join("lily")
    } else {
        PathBuf::from(std::env::var_os("HOME")?)
            .join(".cache")
            .join("lily")
    };
    Some(base.join("cuda"))
}

pub struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    /// A cache in `dir`; `None` disables caching.
    pub fn new(dir: Option<PathBuf>) -> Self {
        KernelCache { dir }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The key line stored in an entry, and the file name derived from it.
    pub fn key(
        name: &str,
        source: &str,
        options: &[String],
        arch: &str,
        nvrtc: (i32, i32),
    ) -> (String, String) {
        let mut material = source.as_bytes().to_vec();
        for o in options {
            material.push(0);
            material.extend_from_slice(o.as_bytes());
        }
        let h = fnv64(&material);
        let key = format!(
            "{name} {h:016x} {arch} nvrtc-{}.{} len-{}",
            nvrtc.0,
            nvrtc.1,
            source.len()
        );
        let file = format!("{name}-{arch}-nvrtc{}.{}-{h:016x}.cubin", nvrtc.0, nvrtc.1);
        (key, file)
    }

    /// The cached cubin for `key`, if present and intact.
    pub fn get(&self, key: &str, file: &str) -> Option<Vec<u8>> {
        let path = self.dir.as_ref()?.join(file);
        let bytes = std::fs::read(&path).ok()?;
        match decode(&bytes, key) {
            Some(payload) => Some(payload.to_vec()),
            None => {
                tracing::warn!(
                    "kernel cache entry {} is corrupt or stale; rebuilding it",
                    path.display()
                );
                None
            }
        }
    }

    /// Stores a cubin; failures only log (the cache is an optimisation).
    pub fn put(&self, key: &str, file: &str, cubin: &[u8]) {
        let Some(dir) = &self.dir else { return };
        if let Err(e) = write_atomic(dir, file, &encode(key, cubin)) {
            tracing::warn!(
                "could not write kernel cache entry in {}: {e:#}",
                dir.display()
            );
        }
    }
}

fn encode(key: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + key.len() + 40);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(key.len() as u64).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv64(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn decode<'a>(bytes: &'a [u8], key: &str) -> Option<&'a [u8]> {
    let rest = bytes.strip_prefix(MAGIC.as_slice())?;
    let (klen, rest) = split_u64(rest)?;
    let klen = usize::try_from(klen).ok()?;
    if rest.len() < klen || &rest[..klen] != key.as_bytes() {
        return None;
    }
    let rest = &rest[klen..];
    let (plen, rest) = split_u64(rest)?;
    let (sum, payload) = split_u64(rest)?;
    if payload.len() as u64 != plen || plen == 0 || fnv64(payload) != sum {
        return None;
    }
    Some(payload)
}

fn split_u64(b: &[u8]) -> Option<(u64, &[u8])> {
    let head: [u8; 8] = b.get(..8)?.try_into().ok()?;
    Some((u64::from_le_bytes(head), &b[8..]))
}

fn write_atomic(dir: &Path, file: &str, bytes: &[u8]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(".{file}.{}.{nonce}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(file)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lily-cache-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trips_an_entry() {
        let cache = KernelCache::new(Some(temp_dir("rt")));
        let (key, file) = KernelCache::key("norm", "src", &[], "sm_90a", (13, 0));
        assert!(cache.get(&key, &file).is_none());
        cache.put(&key, &file, b"\x7fELF cubin bytes");
        assert_eq!(
            cache.get(&key, &file).as_deref(),
            Some(&b"\x7fELF cubin bytes"[..])
        );
    }

    #[test]
    fn corrupt_or_truncated_entries_are_refused() {
        let dir = temp_dir("corrupt");
        let cache = KernelCache::new(Some(dir.clone()));
        let (key, file) = KernelCache::key("moe", "src", &[], "sm_90a", (13, 0));
        cache.put(&key, &file, &[7u8; 300]);
        let path = dir.join(&file);
        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert!(
            cache.get(&key, &file).is_none(),
            "a flipped payload bit must be caught"
        );
        std::fs::write(&path, &good[..good.len() - 10]).unwrap();
        assert!(
            cache.get(&key, &file).is_none(),
            "a truncated entry must be caught"
        );
        std::fs::write(&path, &good).unwrap();
        let (other_key, _) = KernelCache::key("moe", "src", &[], "sm_80", (13, 0));
        assert!(
            cache.get(&other_key, &file).is_none(),
            "an entry for another key must not be used"
        );
    }

    #[test]
    fn key_depends_on_source_options_arch_and_version() {
        let base = KernelCache::key("x", "a", &[], "sm_90a", (13, 0));
        assert_ne!(base, KernelCache::key("x", "b", &[], "sm_90a", (13, 0)));
        assert_ne!(
            base,
            KernelCache::key("x", "a", &["-DX".into()], "sm_90a", (13, 0))
        );
        assert_ne!(base, KernelCache::key("x", "a", &[], "sm_89", (13, 0)));
        assert_ne!(base, KernelCache::key("x", "a", &[], "sm_90a", (13, 1)));
    }
}
