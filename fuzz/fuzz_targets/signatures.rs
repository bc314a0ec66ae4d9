//! The webhook signature schemes. Hostile headers and bodies are rejected without a panic;
//! a request signed with the secret verifies, and no longer does once its body changes or
//! its signature is edited into anything but a spelling of the same signature.
#![no_main]

use arbitrary::Arbitrary;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use justonce_http::receiver::{Scheme, standard_webhooks_signature};
use libfuzzer_sys::fuzz_target;
use sha2::Sha256;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Kind {
    StandardWebhooks,
    Stripe,
    Github,
    HmacSha256,
}

/// The names the schemes read, so that hostile values reach the parsers, and any other.
#[derive(Arbitrary, Debug)]
enum Name {
    WebhookId,
    WebhookTimestamp,
    WebhookSignature,
    StripeSignature,
    HubSignature,
    Custom,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum Input {
    /// Anything at all: it must not verify, short of a forged HMAC.
    Hostile {
        kind: Kind,
        secrets: Vec<Vec<u8>>,
        /// For Standard Webhooks, secrets as configured (`whsec_` or `whpk_`, and base64).
        written_secrets: Vec<String>,
        tolerance: u64,
        /// The header HmacSha256 reads: any text, as the enum's field allows.
        custom: String,
        headers: Vec<(Name, Vec<u8>)>,
        body: Vec<u8>,
    },
    /// A request signed with the first secret, then changed.
    Signed {
        kind: Kind,
        secret: Vec<u8>,
        other_secrets: Vec<Vec<u8>>,
        id: String,
        tolerance: u16,
        body: Vec<u8>,
        /// Byte replacements in the signature header's value: `(position, byte)`.
        edits: Vec<(u16, u8)>,
        flip: u16,
    },
}

const CUSTOM: &str = "x-signature";

fuzz_target!(|input: Input| match input {
    Input::Hostile {
        kind,
        secrets,
        written_secrets,
        tolerance,
        custom,
        headers,
        body,
    } => {
        let tolerance = Duration::from_secs(tolerance);
        let scheme = match kind {
            Kind::StandardWebhooks => {
                match Scheme::standard_webhooks(&written_secrets, tolerance) {
                    Ok(scheme) => scheme,
                    Err(_) => return,
                }
            }
            Kind::HmacSha256 => Scheme::HmacSha256 {
                secrets,
                header: custom.clone(),
            },
            kind => scheme(kind, secrets, tolerance),
        };
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            let name = match name {
                Name::WebhookId => HeaderName::from_static("webhook-id"),
                Name::WebhookTimestamp => HeaderName::from_static("webhook-timestamp"),
                Name::WebhookSignature => HeaderName::from_static("webhook-signature"),
                Name::StripeSignature => HeaderName::from_static("stripe-signature"),
                Name::HubSignature => HeaderName::from_static("x-hub-signature-256"),
                Name::Custom => match HeaderName::try_from(custom.as_str()) {
                    Ok(name) => name,
                    Err(_) => continue,
                },
                Name::Other(name) => match HeaderName::try_from(name) {
                    Ok(name) => name,
                    Err(_) => continue,
                },
            };
            if let Ok(value) = HeaderValue::from_bytes(&value) {
                map.append(name, value);
            }
        }
        // Without the secret, a forged HMAC is out of the fuzzer's reach: anything that
        // verifies here is a parser accepting what it should not.
        assert!(
            scheme.verify(&map, &body).is_err(),
            "{scheme:?} accepted {map:?}"
        );
    }
    Input::Signed {
        kind,
        secret,
        other_secrets,
        id,
        tolerance,
        body,
        edits,
        flip,
    } => {
        // A second of slack: the clock may tick between signing and verifying.
        let tolerance = Duration::from_secs(u64::from(tolerance) + 1);
        let mut secrets = vec![secret.clone()];
        secrets.extend(other_secrets);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let (scheme, mut headers, signature_header, signature) = match kind {
            Kind::StandardWebhooks => {
                let written: Vec<String> = secrets
                    .iter()
                    .map(|key| format!("whsec_{}", STANDARD.encode(key)))
                    .collect();
                let scheme = Scheme::standard_webhooks(&written, tolerance).unwrap();
                // The receiver reads header values as visible ASCII (RFC 9110's advice for
                // field values); a sender's id outside it is refused, signed or not.
                let Ok(id_value) = HeaderValue::from_str(&id) else {
                    return;
                };
                if id_value.to_str().is_err() {
                    return;
                }
                let signature = standard_webhooks_signature(&secret, &id, now, &body);
                let mut headers = HeaderMap::new();
                headers.insert("webhook-id", id_value);
                headers.insert("webhook-timestamp", HeaderValue::from(now));
                headers.insert("webhook-signature", signature.parse().unwrap());
                (scheme, headers, "webhook-signature", signature)
            }
            Kind::Stripe => {
                let signature = hex(&hmac(&secret, &[now.to_string().as_bytes(), b".", &body]));
                let mut headers = HeaderMap::new();
                let value = format!("t={now},v1={signature}");
                headers.insert("stripe-signature", value.parse().unwrap());
                let scheme = scheme(kind, secrets, tolerance);
                (scheme, headers, "stripe-signature", signature)
            }
            Kind::Github | Kind::HmacSha256 => {
                let signature = hex(&hmac(&secret, &[&body]));
                let (name, value) = match kind {
                    Kind::Github => ("x-hub-signature-256", format!("sha256={signature}")),
                    _ => (CUSTOM, signature.clone()),
                };
                let mut headers = HeaderMap::new();
                headers.insert(name, value.parse().unwrap());
                (scheme(kind, secrets, tolerance), headers, name, signature)
            }
        };
        assert_eq!(
            scheme.verify(&headers, &body),
            Ok(()),
            "{scheme:?} rejected its own signature"
        );
        if !body.is_empty() {
            let mut changed = body.clone();
            let at = usize::from(flip) % changed.len();
            changed[at] ^= 1 << (flip % 8);
            assert!(
                scheme.verify(&headers, &changed).is_err(),
                "{scheme:?} accepted a changed body"
            );
        }
        if edits.is_empty() {
            return;
        }
        let mut value = headers[signature_header].as_bytes().to_vec();
        for (position, byte) in edits {
            let position = usize::from(position) % value.len();
            value[position] = byte;
        }
        let Ok(edited) = HeaderValue::from_bytes(&value) else {
            return;
        };
        headers.insert(signature_header, edited);
        if scheme.verify(&headers, &body).is_ok() {
            // Still verifying: the edits changed what lies around the signature or, in hex,
            // the case of its digits; never what it spells.
            let mut text = String::from_utf8_lossy(&value).into_owned();
            if !matches!(kind, Kind::StandardWebhooks) {
                text.make_ascii_lowercase();
            }
            assert!(
                text.contains(&signature),
                "{scheme:?} accepted the edited signature {text:?} for {signature:?}"
            );
        }
    }
});

fn scheme(kind: Kind, secrets: Vec<Vec<u8>>, tolerance: Duration) -> Scheme {
    match kind {
        Kind::StandardWebhooks => Scheme::StandardWebhooks {
            keys: secrets,
            public_keys: Vec::new(),
            tolerance,
        },
        Kind::Stripe => Scheme::Stripe { secrets, tolerance },
        Kind::Github => Scheme::Github { secrets },
        Kind::HmacSha256 => Scheme::HmacSha256 {
            secrets,
            header: CUSTOM.to_owned(),
        },
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
