use crate::{Error, Invalid};
use sha2::{Digest, Sha256};
use std::fmt;

/// Checks the rules shared by keys, consumer names and scopes: not empty, at most `max`
/// bytes, no NUL or other control character.
fn check(value: &str, max: usize) -> Result<(), Invalid> {
    if value.is_empty() {
        return Err(Invalid::Empty);
    }
    if value.len() > max {
        return Err(Invalid::TooLong {
            len: value.len(),
            max,
        });
    }
    match value.char_indices().find(|(_, c)| c.is_control()) {
        Some((position, character)) => Err(Invalid::ControlCharacter {
            character,
            position,
        }),
        None => Ok(()),
    }
}

/// The identity of one unit of work: a message id, or a purpose key such as
/// `invoice:2026-10:cust_481`.
///
/// A key is 1 to 255 bytes of UTF-8 without control characters. Keys are compared byte for
/// byte as given: no Unicode normalisation, no case folding, no trimming. `"café"` written
/// with a precomposed `é` (NFC) and with `e` plus a combining accent (NFD) are two keys;
/// normalise before building the key if your sender may spell one id both ways. A key of
/// spaces only is a key, and invisible format characters such as U+200F RIGHT-TO-LEFT MARK
/// are kept: `"a\u{200F}b"` and `"ab"` are two keys. The same holds for consumer names
/// and scopes.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

impl Key {
    /// The longest key, in UTF-8 bytes.
    pub const MAX_LEN: usize = 255;
    /// The separator between the parts of a purpose key.
    pub const SEPARATOR: char = ':';

    /// A key taken as given, such as a broker's message id.
    pub fn new(key: impl Into<String>) -> Result<Self, Error> {
        let key = key.into();
        check(&key, Self::MAX_LEN).map_err(Error::InvalidKey)?;
        Ok(Self(key))
    }

    /// A purpose key: the parts joined with `:`.
    ///
    /// A part that is empty or contains `:` is rejected rather than escaped, so that every
    /// purpose key reads back into the parts it was made of.
    ///
    /// ```
    /// # use justonce_core::Key;
    /// let key = Key::purpose(["invoice", "2026-10", "cust_481"])?;
    /// assert_eq!(key.to_string(), "invoice:2026-10:cust_481");
    /// assert!(Key::purpose(["invoice", "a:b"]).is_err());
    /// # Ok::<(), justonce_core::Error>(())
    /// ```
    pub fn purpose<I>(parts: I) -> Result<Self, Error>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut key = String::new();
        for (index, part) in parts.into_iter().enumerate() {
            let part = part.as_ref();
            if part.is_empty() || part.contains(Self::SEPARATOR) {
                return Err(Error::InvalidKey(Invalid::BadPart {
                    index,
                    part: part.to_owned(),
                }));
            }
            if index > 0 {
                key.push(Self::SEPARATOR);
            }
            key.push_str(part);
        }
        Self::new(key)
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The explicit, stable name of a handler, such as `billing`.
///
/// Keys are scoped by consumer, so several consumers can share one store and each process
/// the same message once. Name consumers yourself and never derive the name from a type or
/// a code path: renaming one makes every key it claimed look new. 1 to 128 bytes of UTF-8
/// without control characters.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Consumer(String);

impl Consumer {
    /// The longest consumer name, in UTF-8 bytes.
    pub const MAX_LEN: usize = 128;

    /// A consumer with this name.
    pub fn new(name: impl Into<String>) -> Result<Self, Error> {
        let name = name.into();
        check(&name, Self::MAX_LEN).map_err(Error::InvalidConsumer)?;
        Ok(Self(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An optional tenant namespace. [`Scope::none`] (the default) is stored as the empty
/// string, so that it takes part in the unique constraint like any other scope.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(String);

impl Scope {
    /// The longest scope, in UTF-8 bytes.
    pub const MAX_LEN: usize = 128;

    /// No tenant.
    pub fn none() -> Self {
        Self(String::new())
    }

    /// A tenant's scope: 1 to 128 bytes of UTF-8 without control characters.
    pub fn new(tenant: impl Into<String>) -> Result<Self, Error> {
        let tenant = tenant.into();
        check(&tenant, Self::MAX_LEN).map_err(Error::InvalidScope)?;
        Ok(Self(tenant))
    }

    /// The scope as stored: empty for no tenant.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The unique identity of one unit of work: (scope, consumer, key).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    /// The tenant, or [`Scope::none`].
    pub scope: Scope,
    /// The handler.
    pub consumer: Consumer,
    /// The unit of work.
    pub key: Key,
}

impl Identity {
    /// The identity of `key` for `consumer` within `scope`.
    pub fn new(scope: Scope, consumer: Consumer, key: Key) -> Self {
        Self {
            scope,
            consumer,
            key,
        }
    }

    /// The idempotency key of one downstream step of this unit of work.
    ///
    /// The same identity and step always give the same key, so a re-run or a replay sends
    /// the same key; two consumers of one message give two different keys, so a receiver
    /// that deduplicates does not drop one of them. The key is the hex SHA-256 of the
    /// length-prefixed parts: 64 characters, whatever the inputs.
    ///
    /// ```
    /// # use justonce_core::{Consumer, Identity, Key, Scope};
    /// let key = Key::new("evt_1")?;
    /// let billing = Identity::new(Scope::none(), Consumer::new("billing")?, key.clone());
    /// let audit = Identity::new(Scope::none(), Consumer::new("audit")?, key);
    /// assert_eq!(billing.derive("email"), billing.derive("email"));
    /// assert_ne!(billing.derive("email"), audit.derive("email"));
    /// assert_eq!(billing.derive("email").as_str().len(), 64);
    /// # Ok::<(), justonce_core::Error>(())
    /// ```
    pub fn derive(&self, step: &str) -> DerivedKey {
        let mut hash = Sha256::new();
        for part in [
            self.scope.as_str(),
            self.consumer.as_str(),
            self.key.as_str(),
            step,
        ] {
            // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        let digest: [u8; 32] = hash.finalize().into();
        DerivedKey(digest.iter().map(|byte| format!("{byte:02x}")).collect())
    }
}

/// The idempotency key of one downstream step, made by [`Identity::derive`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DerivedKey(String);

impl DerivedKey {
    /// The key as 64 lowercase hex characters.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

macro_rules! text_traits {
    ($($name:ident),*) => {$(
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    )*};
}

text_traits!(Key, Consumer, Scope);

impl fmt::Display for DerivedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_validated_before_use() {
        assert!(matches!(Key::new(""), Err(Error::InvalidKey(_))));
        assert!(Key::new("k".repeat(255)).is_ok());
        assert!(matches!(
            Key::new("k".repeat(256)),
            Err(Error::InvalidKey(Invalid::TooLong { len: 256, max: 255 }))
        ));
        // 128 two-byte characters: 256 bytes, although only 128 characters.
        assert!(Key::new("é".repeat(128)).is_err());
        for bad in ["a\0b", "tab\there", "line\n", "\u{7f}", "c1\u{85}"] {
            assert!(
                matches!(
                    Key::new(bad),
                    Err(Error::InvalidKey(Invalid::ControlCharacter { .. }))
                ),
                "{bad:?} was accepted"
            );
        }
    }

    /// Keys, consumer names and scopes share one check; each is tried with the same hostile
    /// texts against its own limit.
    #[test]
    fn hostile_texts_are_refused_with_a_reason_or_kept_byte_for_byte() {
        type Make = fn(String) -> Result<String, Error>;
        type IsOwnVariant = fn(&Error) -> bool;
        let kinds: [(Make, usize, IsOwnVariant); 3] = [
            (
                |t| Key::new(t).map(|k| k.0),
                Key::MAX_LEN,
                |e| matches!(e, Error::InvalidKey(_)),
            ),
            (
                |t| Consumer::new(t).map(|c| c.0),
                Consumer::MAX_LEN,
                |e| matches!(e, Error::InvalidConsumer(_)),
            ),
            (
                |t| Scope::new(t).map(|s| s.0),
                Scope::MAX_LEN,
                |e| matches!(e, Error::InvalidScope(_)),
            ),
        ];
        for (make, max, is_own_variant) in kinds {
            let reason = |text: String| match make(text.clone()) {
                Err(
                    Error::InvalidKey(why) | Error::InvalidConsumer(why) | Error::InvalidScope(why),
                ) => why,
                other => panic!("{text:?} gave {other:?}, not an invalid value"),
            };
            let empty = make(String::new()).unwrap_err();
            assert!(is_own_variant(&empty), "{empty:?}");
            assert_eq!(reason(String::new()), Invalid::Empty);
            let crab = "\u{1f980}"; // four bytes
            let at_limit = [
                "k".repeat(max),
                format!("{}{}", crab.repeat(max / 4), "k".repeat(max % 4)),
            ];
            for text in at_limit {
                assert_eq!(text.len(), max);
                assert_eq!(make(text.clone()).unwrap(), text);
            }
            for text in [
                "k".repeat(max + 1),
                format!("{}k", crab.repeat(max / 4 + 1)),
            ] {
                let len = text.len();
                assert_eq!(reason(text), Invalid::TooLong { len, max });
            }
            // A mebibyte is refused by its length, and the message does not repeat it.
            let huge = "k".repeat(1 << 20);
            let message = make(huge.clone()).unwrap_err().to_string();
            assert_eq!(reason(huge), Invalid::TooLong { len: 1 << 20, max });
            assert!(message.len() < 100, "{message}");
            for (text, character, position) in [
                ("a\0b", '\0', 1),
                ("\r", '\r', 0),
                ("esc\u{1b}[2J", '\u{1b}', 3),
                ("\u{e9}\u{85}", '\u{85}', 2),
                ("del\u{7f}", '\u{7f}', 3),
            ] {
                assert_eq!(
                    reason(text.to_owned()),
                    Invalid::ControlCharacter {
                        character,
                        position
                    },
                    "{text:?}"
                );
            }
            // Kept exactly as given: no trimming, no normalisation, nothing escaped.
            for text in [
                " ",
                "   ",
                "'; DROP TABLE x; --",
                "a\\b%_\"`",
                "\u{1f980}\u{1f468}\u{200d}\u{1f469}",
                "a\u{200f}b",
                "caf\u{e9}",
                "cafe\u{301}",
            ] {
                assert_eq!(make(text.to_owned()).unwrap(), text);
            }
        }
    }

    #[test]
    fn keys_are_compared_as_given() {
        let nfc = Key::new("caf\u{e9}").unwrap();
        let nfd = Key::new("cafe\u{301}").unwrap();
        assert_ne!(nfc, nfd);
        assert_ne!(Key::new("A").unwrap(), Key::new("a").unwrap());
        assert_ne!(Key::new("k ").unwrap(), Key::new("k").unwrap());
    }

    #[test]
    fn purpose_keys_reject_separators_and_empty_parts() {
        let key = Key::purpose(["invoice", "2026-10", "cust_481"]).unwrap();
        assert_eq!(key.as_str(), "invoice:2026-10:cust_481");
        assert!(matches!(
            Key::purpose(["invoice", "a:b"]),
            Err(Error::InvalidKey(Invalid::BadPart { index: 1, .. }))
        ));
        assert!(Key::purpose(["invoice", ""]).is_err());
        assert!(Key::purpose(Vec::<&str>::new()).is_err());
    }

    #[test]
    fn consumers_and_scopes_are_validated() {
        assert!(matches!(Consumer::new(""), Err(Error::InvalidConsumer(_))));
        assert!(Consumer::new("c".repeat(128)).is_ok());
        assert!(Consumer::new("c".repeat(129)).is_err());
        assert!(Consumer::new("bill\0ing").is_err());
        assert!(matches!(Scope::new(""), Err(Error::InvalidScope(_))));
        assert_eq!(Scope::none().as_str(), "");
        assert_eq!(Scope::default(), Scope::none());
    }

    #[test]
    fn derived_keys_separate_every_part() {
        let id = |scope: &str, consumer: &str, key: &str| {
            let scope = if scope.is_empty() {
                Scope::none()
            } else {
                Scope::new(scope).unwrap()
            };
            Identity::new(
                scope,
                Consumer::new(consumer).unwrap(),
                Key::new(key).unwrap(),
            )
        };
        let base = id("", "billing", "evt_1").derive("email");
        assert_eq!(base, id("", "billing", "evt_1").derive("email"));
        assert_ne!(base, id("t1", "billing", "evt_1").derive("email"));
        assert_ne!(base, id("", "audit", "evt_1").derive("email"));
        assert_ne!(base, id("", "billing", "evt_2").derive("email"));
        assert_ne!(base, id("", "billing", "evt_1").derive("sms"));
        assert_ne!(id("", "ab", "c").derive("x"), id("", "a", "bc").derive("x"));
        assert!(base.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
