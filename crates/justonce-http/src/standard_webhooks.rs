//! [Standard Webhooks](https://www.standardwebhooks.com/) secrets and signatures, shared by
//! the receiver, which checks them, and the destination, which makes them.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use justonce_core::Error;
use sha2::Sha256;

/// The key of a secret written `whsec_` and the base64 of the key bytes. The error says
/// what is wrong without repeating the secret.
pub(crate) fn decode_secret(secret: &str) -> Result<Vec<u8>, Error> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    let key = STANDARD.decode(encoded).map_err(|_| {
        Error::Config("a Standard Webhooks secret must be whsec_ followed by base64".to_owned())
    })?;
    // An empty key makes an HMAC anyone can compute.
    if key.is_empty() {
        return Err(Error::Config(
            "a Standard Webhooks secret is empty: whsec_ must be followed by the key's base64"
                .to_owned(),
        ));
    }
    Ok(key)
}

/// The `webhook-signature` value Standard Webhooks expects for this message: `v1,` and the
/// base64 of the HMAC-SHA256 of `id.timestamp.body` under `key` (the decoded secret).
pub fn signature(key: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let mac = hmac_sha256(
        key,
        &[
            id.as_bytes(),
            b".",
            timestamp.to_string().as_bytes(),
            b".",
            body,
        ],
    );
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// An HMAC-SHA256 over the concatenated `parts`, ready to finish or verify.
pub(crate) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac
}
