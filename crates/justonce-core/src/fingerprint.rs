use sha2::{Digest, Sha256};
use std::fmt;

/// The SHA-256 of a payload, computed by justonce and stored with its key.
///
/// A duplicate whose fingerprint differs from the stored one is a key reuse: the sender
/// used one key for two different messages. It is reported, never merged.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of `payload`'s bytes.
    pub fn of(payload: impl AsRef<[u8]>) -> Self {
        Self(Sha256::digest(payload.as_ref()).into())
    }

    /// A fingerprint read back from storage.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes of the hash.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_the_sha256_of_the_payload() {
        assert_eq!(
            Fingerprint::of(b"abc").to_string(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_ne!(Fingerprint::of(b"abc"), Fingerprint::of(b"abd"));
    }
}
