//! Webhook signature schemes. Every HMAC check compares in constant time over the raw bytes
//! (an ed25519 check compares only public values), and every failure is the same
//! [`Rejected`]: the sender is not told which check failed.

use crate::standard_webhooks::{decode_secret, hmac_sha256};
use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{PUBLIC_KEY_LENGTH, Signature, VerifyingKey};
use hmac::Mac;
use justonce_core::Error;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A signature that does not verify, for whatever reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected;

/// How a source signs its webhooks, with the secrets to check them (several during a
/// rotation: any one verifies).
#[derive(Clone)]
pub enum Scheme {
    /// [Standard Webhooks](https://www.standardwebhooks.com/): `webhook-id`,
    /// `webhook-timestamp` and `webhook-signature` over `id.timestamp.body`. The signature
    /// header holds space-separated entries, and one that verifies is enough: `v1,<base64>`
    /// is an HMAC-SHA256 checked with the `whsec_` secrets, `v1a,<base64>` an ed25519
    /// signature checked with the `whpk_` public keys.
    StandardWebhooks {
        /// The decoded `whsec_` keys, for `v1` entries.
        keys: Vec<Vec<u8>>,
        /// The decoded `whpk_` public keys, for `v1a` entries.
        public_keys: Vec<VerifyingKey>,
        /// How far the signed timestamp may be from now, either way.
        tolerance: Duration,
    },
    /// Stripe: `Stripe-Signature: t=<unix>,v1=<hex>` over `t.body`, keyed by the `whsec_...`
    /// string itself.
    Stripe {
        /// The signing secrets as given.
        secrets: Vec<Vec<u8>>,
        /// How far the signed timestamp may be from now, either way.
        tolerance: Duration,
    },
    /// GitHub: `X-Hub-Signature-256: sha256=<hex>` over the body. No timestamp is signed.
    Github {
        /// The webhook secrets as given.
        secrets: Vec<Vec<u8>>,
    },
    /// A hex HMAC-SHA256 of the body in one header, `sha256=` prefix allowed. No timestamp
    /// is signed.
    HmacSha256 {
        /// The secrets as given.
        secrets: Vec<Vec<u8>>,
        /// The header that carries the signature.
        header: String,
    },
    /// No signature: only for senders on a trusted network.
    None,
}

impl std::fmt::Debug for Scheme {
    /// Names the scheme and never prints a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Scheme::StandardWebhooks { .. } => "StandardWebhooks",
            Scheme::Stripe { .. } => "Stripe",
            Scheme::Github { .. } => "Github",
            Scheme::HmacSha256 { .. } => "HmacSha256",
            Scheme::None => "None",
        })
    }
}

impl Scheme {
    /// The Standard Webhooks scheme for secrets written `whsec_<base64>` and public keys
    /// written `whpk_<base64>`, in any mix. An unusable entry is an [`Error::Config`] that
    /// names its position and the problem, never its value.
    pub fn standard_webhooks(secrets: &[String], tolerance: Duration) -> Result<Self, Error> {
        let mut keys = Vec::new();
        let mut public_keys = Vec::new();
        for (n, secret) in secrets.iter().enumerate() {
            let numbered = |error| match error {
                Error::Config(problem) => {
                    Error::Config(format!("secret {} of {}: {problem}", n + 1, secrets.len()))
                }
                other => other,
            };
            if let Some(encoded) = secret.strip_prefix("whpk_") {
                public_keys.push(decode_public_key(encoded).map_err(numbered)?);
            } else if secret.starts_with("whsk_") {
                // The signer's secret key does not belong on the receiving side.
                return Err(numbered(Error::Config(
                    "a whsk_ key is the sender's secret: give its whpk_ public key instead"
                        .to_owned(),
                )));
            } else {
                keys.push(decode_secret(secret).map_err(numbered)?);
            }
        }
        Ok(Scheme::StandardWebhooks {
            keys,
            public_keys,
            tolerance,
        })
    }

    /// Checks `body` and `headers` as received.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), Rejected> {
        self.verify_at(headers, body, SystemTime::now())
    }

    fn verify_at(&self, headers: &HeaderMap, body: &[u8], now: SystemTime) -> Result<(), Rejected> {
        match self {
            Scheme::StandardWebhooks {
                keys,
                public_keys,
                tolerance,
            } => {
                let id = header(headers, "webhook-id")?;
                let timestamp = header(headers, "webhook-timestamp")?;
                check_timestamp(timestamp, *tolerance, now)?;
                let signed = [id.as_bytes(), b".", timestamp.as_bytes(), b".", body];
                let mut macs = Vec::new();
                let mut signatures = Vec::new();
                for entry in header(headers, "webhook-signature")?.split(' ') {
                    // Entries that do not decode are skipped: another may still verify.
                    match entry.split_once(',') {
                        Some(("v1", encoded)) => macs.extend(STANDARD.decode(encoded).ok()),
                        Some(("v1a", encoded)) => signatures.extend(
                            STANDARD
                                .decode(encoded)
                                .ok()
                                .and_then(|bytes| Signature::from_slice(&bytes).ok()),
                        ),
                        _ => {}
                    }
                }
                // `|`, not `||`: both kinds are always checked, as is every pair within each.
                let hmac = any_verifies(keys, &signed, &macs).is_ok();
                let ed25519 = any_key_signed(public_keys, &signed, &signatures);
                if hmac | ed25519 {
                    Ok(())
                } else {
                    Err(Rejected)
                }
            }
            Scheme::Stripe { secrets, tolerance } => {
                let value = header(headers, "stripe-signature")?;
                let mut timestamp = None;
                let mut signatures = Vec::new();
                for part in value.split(',') {
                    match part.trim().split_once('=') {
                        Some(("t", t)) => timestamp = Some(t),
                        Some(("v1", hex)) => signatures.extend(decode_hex(hex)),
                        _ => {}
                    }
                }
                let timestamp = timestamp.ok_or(Rejected)?;
                check_timestamp(timestamp, *tolerance, now)?;
                any_verifies(secrets, &[timestamp.as_bytes(), b".", body], &signatures)
            }
            Scheme::Github { secrets } => {
                let value = header(headers, "x-hub-signature-256")?;
                let hex = value.strip_prefix("sha256=").ok_or(Rejected)?;
                let signature = decode_hex(hex).ok_or(Rejected)?;
                any_verifies(secrets, &[body], &[signature])
            }
            Scheme::HmacSha256 {
                secrets,
                header: name,
            } => {
                let value = header(headers, name)?;
                let hex = value.strip_prefix("sha256=").unwrap_or(value);
                let signature = decode_hex(hex).ok_or(Rejected)?;
                any_verifies(secrets, &[body], &[signature])
            }
            Scheme::None => Ok(()),
        }
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, Rejected> {
    headers
        .get(name)
        .and_then(|value| value.to_str().ok())
        .ok_or(Rejected)
}

/// A signed timestamp in whole seconds, within `tolerance` of `now` either way.
fn check_timestamp(timestamp: &str, tolerance: Duration, now: SystemTime) -> Result<(), Rejected> {
    let signed = timestamp.parse::<u64>().map_err(|_| Rejected)?;
    let now = now
        .duration_since(UNIX_EPOCH)
        .map_err(|_| Rejected)?
        .as_secs();
    if signed.abs_diff(now) > tolerance.as_secs() {
        return Err(Rejected);
    }
    Ok(())
}

/// Whether any key's HMAC of the concatenated `parts` equals any of `signatures`, each
/// comparison in constant time.
fn any_verifies(keys: &[Vec<u8>], parts: &[&[u8]], signatures: &[Vec<u8>]) -> Result<(), Rejected> {
    let mut verified = false;
    for key in keys {
        let mac = hmac_sha256(key, parts);
        for signature in signatures {
            // `verify_slice` compares in constant time; every pair is tried, so the time
            // taken does not tell which key or signature matched.
            verified |= mac.clone().verify_slice(signature).is_ok();
        }
    }
    if verified { Ok(()) } else { Err(Rejected) }
}

/// Whether any public key signed the concatenated `parts` with any of `signatures`. Every
/// pair is tried, as in [`any_verifies`].
fn any_key_signed(keys: &[VerifyingKey], parts: &[&[u8]], signatures: &[Signature]) -> bool {
    if keys.is_empty() || signatures.is_empty() {
        return false;
    }
    let message = parts.concat();
    let mut verified = false;
    for key in keys {
        for signature in signatures {
            // Strict: small-order points, where ed25519 verifiers disagree, are refused.
            verified |= key.verify_strict(&message, signature).is_ok();
        }
    }
    verified
}

/// The ed25519 public key written after `whpk_`.
fn decode_public_key(encoded: &str) -> Result<VerifyingKey, Error> {
    let problem = |what: &str| Error::Config(format!("a Standard Webhooks public key {what}"));
    let bytes = STANDARD
        .decode(encoded)
        .map_err(|_| problem("must be whpk_ followed by base64"))?;
    let bytes: [u8; PUBLIC_KEY_LENGTH] = bytes.as_slice().try_into().map_err(|_| {
        problem(&format!(
            "must hold {PUBLIC_KEY_LENGTH} bytes, not {}",
            bytes.len()
        ))
    })?;
    let key =
        VerifyingKey::from_bytes(&bytes).map_err(|_| problem("is not an ed25519 curve point"))?;
    // A small-order key verifies forgeries under a lax check and nothing under the strict
    // one: refused here, not by rejecting every event.
    if key.is_weak() {
        return Err(problem("is a weak (small-order) ed25519 key"));
    }
    Ok(key)
}

/// Hex digits only, either case: `from_str_radix` alone also takes a sign, and would read
/// `+5` as `05`, a second spelling of the same signature.
fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};

    fn hmac_bytes(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        hmac_sha256(key, parts).finalize().into_bytes().to_vec()
    }
    use axum::http::HeaderValue;

    const NOW: u64 = 1_790_000_000;
    const MINUTES_5: Duration = Duration::from_secs(300);

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn standard_webhooks() {
        let key = b"a secret key of some length";
        let secret = format!("whsec_{}", STANDARD.encode(key));
        let old = format!("whsec_{}", STANDARD.encode(b"the previous key"));
        let scheme = Scheme::standard_webhooks(&[old, secret], MINUTES_5).unwrap();
        let body = br#"{"type":"order.paid"}"#;
        let sign = |ts: u64, key: &[u8], body: &[u8]| {
            let signature = hmac_bytes(key, &[b"msg_1.", ts.to_string().as_bytes(), b".", body]);
            headers(&[
                ("webhook-id", "msg_1".to_owned()),
                ("webhook-timestamp", ts.to_string()),
                (
                    "webhook-signature",
                    format!("v1,bm9wZQ== v1,{}", STANDARD.encode(signature)),
                ),
            ])
        };
        let ok = sign(NOW, key, body);
        assert_eq!(scheme.verify_at(&ok, body, at(NOW)), Ok(()));
        assert_eq!(
            scheme.verify_at(&sign(NOW, b"the previous key", body), body, at(NOW)),
            Ok(())
        );
        assert_eq!(
            scheme.verify_at(&sign(NOW, b"wrong", body), body, at(NOW)),
            Err(Rejected)
        );
        assert_eq!(
            scheme.verify_at(&ok, br#"{"type":"order.paiD"}"#, at(NOW)),
            Err(Rejected)
        );
        assert_eq!(
            scheme.verify_at(&sign(NOW - 301, key, body), body, at(NOW)),
            Err(Rejected)
        );
        assert_eq!(
            scheme.verify_at(&sign(NOW + 301, key, body), body, at(NOW)),
            Err(Rejected)
        );
        assert_eq!(
            scheme.verify_at(&sign(NOW - 299, key, body), body, at(NOW)),
            Ok(())
        );
        for missing in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            let mut partial = ok.clone();
            partial.remove(missing);
            assert_eq!(
                scheme.verify_at(&partial, body, at(NOW)),
                Err(Rejected),
                "{missing}"
            );
        }
        let mut garbled = ok.clone();
        garbled.insert("webhook-timestamp", HeaderValue::from_static("yesterday"));
        assert_eq!(scheme.verify_at(&garbled, body, at(NOW)), Err(Rejected));
        assert!(Scheme::standard_webhooks(&["whsec_!!".to_owned()], MINUTES_5).is_err());
    }

    /// A `v1a` key pair from a fixed seed: the tests need no random numbers.
    fn key_pair(seed: u8) -> (SigningKey, String) {
        let key = SigningKey::from_bytes(&[seed; 32]);
        let public = format!("whpk_{}", STANDARD.encode(key.verifying_key().as_bytes()));
        (key, public)
    }

    fn v1a(key: &SigningKey, id: &str, ts: u64, body: &[u8]) -> String {
        let signature =
            key.sign(&[id.as_bytes(), b".", ts.to_string().as_bytes(), b".", body].concat());
        format!("v1a,{}", STANDARD.encode(signature.to_bytes()))
    }

    fn webhook(id: &str, ts: u64, signature: &str) -> HeaderMap {
        headers(&[
            ("webhook-id", id.to_owned()),
            ("webhook-timestamp", ts.to_string()),
            ("webhook-signature", signature.to_owned()),
        ])
    }

    /// The signing test of the Standard Webhooks Go library, `TestAsymmetricWebhookSign` in
    /// `libraries/go/webhook_asymmetric_test.go` of
    /// github.com/standard-webhooks/standard-webhooks: its `whsk_` seed, its message and the
    /// signature it expects.
    #[test]
    fn standard_webhooks_v1a_known_vector() {
        let key = SigningKey::from_bytes(b"TESTSIGNINGKEYDONOTUSETHISFORANY");
        let public = format!("whpk_{}", STANDARD.encode(key.verifying_key().as_bytes()));
        let scheme = Scheme::standard_webhooks(&[public], MINUTES_5).unwrap();
        let (id, ts, body) = (
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1_614_265_330,
            br#"{"test": 2432232314}"#,
        );
        let expected = "v1a,tQ9V2XOqn7jL/DQenEFpqIugdBVtiMmER5mhSkXBNwM0mkATuDe6KYYUuxqtaiHeYGb7KaaBRdM5WqyeFiL8Ag==";
        assert_eq!(v1a(&key, id, ts, body), expected);
        assert_eq!(
            scheme.verify_at(&webhook(id, ts, expected), body, at(ts)),
            Ok(())
        );
        assert_eq!(
            scheme.verify_at(&webhook(id, ts, expected), body, at(NOW)),
            Err(Rejected)
        );
    }

    #[test]
    fn standard_webhooks_v1a() {
        let (old, old_public) = key_pair(1);
        let (new, new_public) = key_pair(2);
        let (stranger, _) = key_pair(3);
        let scheme = Scheme::standard_webhooks(&[old_public, new_public], MINUTES_5).unwrap();
        let body = br#"{"type":"order.paid"}"#;
        let check = |ts: u64, signature: &str, body: &[u8]| {
            scheme.verify_at(&webhook("msg_1", ts, signature), body, at(NOW))
        };
        let signed = v1a(&new, "msg_1", NOW, body);
        assert_eq!(check(NOW, &signed, body), Ok(()));
        assert_eq!(check(NOW, &v1a(&old, "msg_1", NOW, body), body), Ok(()));
        assert_eq!(
            check(NOW, &v1a(&stranger, "msg_1", NOW, body), body),
            Err(Rejected)
        );
        assert_eq!(
            check(NOW, &signed, br#"{"type":"order.paiD"}"#),
            Err(Rejected)
        );
        assert_eq!(
            scheme.verify_at(&webhook("msg_2", NOW, &signed), body, at(NOW)),
            Err(Rejected)
        );
        for ts in [NOW - 301, NOW + 301] {
            assert_eq!(
                check(ts, &v1a(&new, "msg_1", ts, body), body),
                Err(Rejected),
                "{ts}"
            );
        }
        assert_eq!(
            check(NOW - 300, &v1a(&new, "msg_1", NOW - 300, body), body),
            Ok(())
        );

        // Any one byte of the signature changed, in any bit.
        let bytes = STANDARD.decode(&signed["v1a,".len()..]).unwrap();
        for at_byte in 0..bytes.len() {
            for bit in 0..8 {
                let mut edited = bytes.clone();
                edited[at_byte] ^= 1 << bit;
                let edited = format!("v1a,{}", STANDARD.encode(&edited));
                assert_eq!(
                    check(NOW, &edited, body),
                    Err(Rejected),
                    "byte {at_byte} bit {bit}"
                );
            }
        }

        // Malformed entries are skipped, never a panic; one good entry beside them verifies.
        let short = format!("v1a,{}", STANDARD.encode(&bytes[..63]));
        let long = format!("v1a,{}", STANDARD.encode([bytes.as_slice(), &[0]].concat()));
        let unpadded = signed.trim_end_matches('=');
        let malformed = [
            "v1a,",
            "v1a",
            "v1a,!!!!",
            "v1a,bm9wZQ==",
            &short,
            &long,
            unpadded,
            &format!("{signed},"),
            &signed.replacen("v1a", "V1A", 1),
            &signed.replacen("v1a", "v1", 1),
            &signed.replacen("v1a,", "v1a ", 1),
        ];
        for entry in malformed {
            assert_eq!(check(NOW, entry, body), Err(Rejected), "{entry:?}");
        }
        assert_eq!(
            check(NOW, &format!("{} {signed}", malformed.join(" ")), body),
            Ok(())
        );
    }

    #[test]
    fn standard_webhooks_mixes_v1_and_v1a() {
        let hmac_key = b"a secret key of some length";
        let whsec = format!("whsec_{}", STANDARD.encode(hmac_key));
        let (key, whpk) = key_pair(7);
        let body = b"{}";
        let v1 = |key: &[u8]| {
            let mac = hmac_bytes(key, &[b"msg_1.", NOW.to_string().as_bytes(), b".", body]);
            format!("v1,{}", STANDARD.encode(mac))
        };
        let (good_v1, bad_v1) = (v1(hmac_key), v1(b"wrong"));
        let good_v1a = v1a(&key, "msg_1", NOW, body);
        let bad_v1a = v1a(&key_pair(8).0, "msg_1", NOW, body);
        let mixed = Scheme::standard_webhooks(&[whpk.clone(), whsec.clone()], MINUTES_5).unwrap();
        let only_hmac = Scheme::standard_webhooks(&[whsec], MINUTES_5).unwrap();
        let only_public = Scheme::standard_webhooks(&[whpk], MINUTES_5).unwrap();
        let cases = [
            (&mixed, format!("{bad_v1a} {good_v1}"), Ok(())),
            (&mixed, format!("{good_v1a} {bad_v1}"), Ok(())),
            (&mixed, format!("{bad_v1} {good_v1a} {good_v1}"), Ok(())),
            (&mixed, format!("{bad_v1} {bad_v1a}"), Err(Rejected)),
            (&only_hmac, good_v1a.clone(), Err(Rejected)),
            (&only_hmac, format!("{good_v1a} {good_v1}"), Ok(())),
            (&only_public, good_v1.clone(), Err(Rejected)),
            (&only_public, format!("{good_v1} {good_v1a}"), Ok(())),
        ];
        for (n, (scheme, signature, expected)) in cases.into_iter().enumerate() {
            let request = webhook("msg_1", NOW, &signature);
            assert_eq!(
                scheme.verify_at(&request, body, at(NOW)),
                expected,
                "case {n}"
            );
        }
    }

    #[test]
    fn unusable_standard_webhooks_keys_are_refused_without_their_value() {
        let (_, good) = key_pair(1);
        let public = |bytes: &[u8]| format!("whpk_{}", STANDARD.encode(bytes));
        // Half of all y coordinates have no point on the curve.
        let off_curve = (2..=u8::MAX)
            .map(|y| {
                let mut bytes = [0; 32];
                bytes[0] = y;
                bytes
            })
            .find(|bytes| VerifyingKey::from_bytes(bytes).is_err())
            .unwrap();
        // y = 1: the identity, of order one.
        let mut identity = [0; 32];
        identity[0] = 1;
        let cases = [
            (
                "whpk_not base64!".to_owned(),
                "must be whpk_ followed by base64",
            ),
            (public(&[9; 31]), "must hold 32 bytes, not 31"),
            (public(&[9; 33]), "must hold 32 bytes, not 33"),
            (public(&off_curve), "is not an ed25519 curve point"),
            (public(&identity), "is a weak (small-order) ed25519 key"),
            (
                format!("whsk_{}", STANDARD.encode([9; 32])),
                "give its whpk_ public key",
            ),
            ("whsec_".to_owned(), "secret is empty"),
            (String::new(), "secret is empty"),
            (
                "whsec_not base64!".to_owned(),
                "must be whsec_ followed by base64",
            ),
        ];
        for (bad, why) in cases {
            let Err(Error::Config(message)) =
                Scheme::standard_webhooks(&[good.clone(), bad.clone()], MINUTES_5)
            else {
                panic!("{bad:?} was accepted");
            };
            assert!(message.starts_with("secret 2 of 2: "), "{message}");
            assert!(message.contains(why), "{why:?} not in {message:?}");
            let value = bad.split_once('_').map_or("", |(_, value)| value);
            assert!(value.is_empty() || !message.contains(value), "{message}");
        }
        let scheme = Scheme::standard_webhooks(&[good], MINUTES_5).unwrap();
        assert_eq!(format!("{scheme:?}"), "StandardWebhooks");
    }

    #[test]
    fn stripe() {
        let secret = b"whsec_stripe_test".to_vec();
        let scheme = Scheme::Stripe {
            secrets: vec![secret.clone()],
            tolerance: MINUTES_5,
        };
        let body = br#"{"id":"evt_1"}"#;
        let sign = |ts: u64, key: &[u8]| {
            let signature = hmac_bytes(key, &[ts.to_string().as_bytes(), b".", body]);
            headers(&[(
                "stripe-signature",
                format!("t={ts},v1={},v0=00", hex(&signature)),
            )])
        };
        assert_eq!(scheme.verify_at(&sign(NOW, &secret), body, at(NOW)), Ok(()));
        assert_eq!(
            scheme.verify_at(&sign(NOW, b"whsec_other"), body, at(NOW)),
            Err(Rejected)
        );
        assert_eq!(
            scheme.verify_at(&sign(NOW - 400, &secret), body, at(NOW)),
            Err(Rejected)
        );
        assert_eq!(
            scheme.verify_at(&sign(NOW + 400, &secret), body, at(NOW)),
            Err(Rejected)
        );
        let no_time = headers(&[("stripe-signature", "v1=abcd".to_owned())]);
        assert_eq!(scheme.verify_at(&no_time, body, at(NOW)), Err(Rejected));
        assert_eq!(
            scheme.verify_at(&HeaderMap::new(), body, at(NOW)),
            Err(Rejected)
        );
    }

    #[test]
    fn github_and_plain_hmac() {
        let body = b"payload";
        let signature = hex(&hmac_bytes(b"s3cret", &[body]));
        let github = Scheme::Github {
            secrets: vec![b"s3cret".to_vec()],
        };
        let signed = headers(&[("x-hub-signature-256", format!("sha256={signature}"))]);
        assert_eq!(github.verify_at(&signed, body, at(NOW)), Ok(()));
        let bare = headers(&[("x-hub-signature-256", signature.clone())]);
        assert_eq!(github.verify_at(&bare, body, at(NOW)), Err(Rejected));
        assert_eq!(
            github.verify_at(&signed, b"payloaD", at(NOW)),
            Err(Rejected)
        );

        let plain = Scheme::HmacSha256 {
            secrets: vec![b"s3cret".to_vec()],
            header: "x-signature".to_owned(),
        };
        for value in [signature.clone(), format!("sha256={signature}")] {
            let signed = headers(&[("x-signature", value)]);
            assert_eq!(plain.verify_at(&signed, body, at(NOW)), Ok(()));
        }
        let odd = headers(&[("x-signature", "abc".to_owned())]);
        assert_eq!(plain.verify_at(&odd, body, at(NOW)), Err(Rejected));
        assert_eq!(
            Scheme::None.verify_at(&HeaderMap::new(), body, at(NOW)),
            Ok(())
        );
    }

    /// Found by the `signatures` fuzz target: a hex signature with `+` in place of the `0`
    /// that starts a byte verified, since `from_str_radix` takes a sign.
    #[test]
    fn a_hex_signature_has_one_spelling_besides_its_case() {
        let secret = [[0xff; 36].as_slice(), b"/"].concat();
        let signature = hex(&hmac_bytes(&secret, &[b""]));
        assert_eq!(
            signature,
            "66677a980c5ae78f3eb94d960debc110858e38e05abc4ba2d97e1740f305b3d4"
        );
        let mut plus = signature.clone().into_bytes();
        plus[58] = b'+';
        let plus = String::from_utf8(plus).unwrap();
        let hmac = Scheme::HmacSha256 {
            secrets: vec![secret.clone()],
            header: "x-signature".to_owned(),
        };
        let github = Scheme::Github {
            secrets: vec![secret.clone()],
        };
        for (scheme, name, prefix) in [
            (&hmac, "x-signature", ""),
            (&hmac, "x-signature", "sha256="),
            (&github, "x-hub-signature-256", "sha256="),
        ] {
            let with = |signature: &str| headers(&[(name, format!("{prefix}{signature}"))]);
            assert_eq!(scheme.verify_at(&with(&signature), b"", at(NOW)), Ok(()));
            let upper = signature.to_ascii_uppercase();
            assert_eq!(scheme.verify_at(&with(&upper), b"", at(NOW)), Ok(()));
            assert_eq!(
                scheme.verify_at(&with(&plus), b"", at(NOW)),
                Err(Rejected),
                "{scheme:?} {prefix}{plus}"
            );
        }
        let stripe = Scheme::Stripe {
            secrets: vec![secret.clone()],
            tolerance: MINUTES_5,
        };
        // A body whose signature has a byte below 0x10, so that a `0` can become `+`.
        let (body, signed, plus_at) = (0..)
            .find_map(|n: u32| {
                let body = n.to_string().into_bytes();
                let signed = hex(&hmac_bytes(
                    &secret,
                    &[NOW.to_string().as_bytes(), b".", &body],
                ));
                let at = (0..signed.len())
                    .step_by(2)
                    .find(|&i| signed.as_bytes()[i] == b'0')?;
                Some((body, signed, at))
            })
            .unwrap();
        let stripe_header =
            |signature: &str| headers(&[("stripe-signature", format!("t={NOW},v1={signature}"))]);
        assert_eq!(
            stripe.verify_at(&stripe_header(&signed), &body, at(NOW)),
            Ok(())
        );
        let mut edited = signed.into_bytes();
        edited[plus_at] = b'+';
        let edited = String::from_utf8(edited).unwrap();
        assert_eq!(
            stripe.verify_at(&stripe_header(&edited), &body, at(NOW)),
            Err(Rejected)
        );
    }
}
