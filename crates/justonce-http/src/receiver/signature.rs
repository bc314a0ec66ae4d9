//! Webhook signature schemes. Every check compares in constant time over the raw bytes, and
//! every failure is the same [`Rejected`]: the sender is not told which check failed.

use crate::standard_webhooks::{decode_secret, hmac_sha256};
use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
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
    /// `webhook-timestamp` and `webhook-signature: v1,<base64>` over `id.timestamp.body`;
    /// secrets are `whsec_` and the base64 of the key.
    StandardWebhooks {
        /// The decoded keys.
        keys: Vec<Vec<u8>>,
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
    /// The Standard Webhooks scheme for secrets written `whsec_<base64>`.
    pub fn standard_webhooks(secrets: &[String], tolerance: Duration) -> Result<Self, Error> {
        let keys = secrets
            .iter()
            .map(|secret| decode_secret(secret))
            .collect::<Result<_, _>>()?;
        Ok(Scheme::StandardWebhooks { keys, tolerance })
    }

    /// Checks `body` and `headers` as received.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), Rejected> {
        self.verify_at(headers, body, SystemTime::now())
    }

    fn verify_at(&self, headers: &HeaderMap, body: &[u8], now: SystemTime) -> Result<(), Rejected> {
        match self {
            Scheme::StandardWebhooks { keys, tolerance } => {
                let id = header(headers, "webhook-id")?;
                let timestamp = header(headers, "webhook-timestamp")?;
                check_timestamp(timestamp, *tolerance, now)?;
                let signed = [id.as_bytes(), b".", timestamp.as_bytes(), b".", body];
                let signatures: Vec<Vec<u8>> = header(headers, "webhook-signature")?
                    .split(' ')
                    .filter_map(|part| part.strip_prefix("v1,"))
                    .filter_map(|encoded| STANDARD.decode(encoded).ok())
                    .collect();
                any_verifies(keys, &signed, &signatures)
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
