//! Keys, purpose keys, consumer names and scopes: whatever the text, each is refused with a
//! reason or kept byte for byte, and an accepted one keeps the documented rules.
#![no_main]

use arbitrary::Arbitrary;
use justonce_core::{Consumer, Error, Identity, Invalid, Key, Scope};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Input {
    Key(String),
    Consumer(String),
    Scope(String),
    Purpose(Vec<String>),
    /// Two identities with a step each: the derived keys differ unless all four parts do not.
    Derive([String; 4], [String; 4]),
}

fuzz_target!(|input: Input| match input {
    Input::Key(text) => {
        let made = Key::new(text.clone()).map(|key| key.to_string());
        check(&text, Key::MAX_LEN, made, |e| {
            matches!(e, Error::InvalidKey(_))
        });
    }
    Input::Consumer(text) => {
        let made = Consumer::new(text.clone()).map(|consumer| consumer.to_string());
        check(&text, Consumer::MAX_LEN, made, |e| {
            matches!(e, Error::InvalidConsumer(_))
        });
    }
    Input::Scope(text) => {
        let made = Scope::new(text.clone()).map(|scope| scope.as_str().to_owned());
        check(&text, Scope::MAX_LEN, made, |e| {
            matches!(e, Error::InvalidScope(_))
        });
    }
    Input::Purpose(parts) => purpose(&parts),
    Input::Derive(a, b) => {
        if let (Some((one, step_one)), Some((two, step_two))) = (identity(&a), identity(&b)) {
            let (derived_one, derived_two) = (one.derive(step_one), two.derive(step_two));
            assert_eq!(derived_one, one.derive(step_one), "derive is not stable");
            let text = derived_one.as_str();
            assert!(
                text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
                "{text:?} is not 64 lowercase hex characters"
            );
            assert_eq!(
                derived_one == derived_two,
                (one, step_one) == (two, step_two),
                "derived keys of different parts collide, or of equal parts differ"
            );
        }
    }
});

/// The documented rule: 1 to `max` bytes of UTF-8 without a control character (NUL, C0, DEL,
/// C1), taken as given: no trimming, no normalisation. A refusal is the maker's own variant.
fn check(text: &str, max: usize, made: Result<String, Error>, is_own_variant: fn(&Error) -> bool) {
    let valid = !text.is_empty() && text.len() <= max && !text.chars().any(char::is_control);
    match made {
        Ok(kept) => {
            assert!(valid, "{text:?} was accepted");
            assert_eq!(kept, text, "the text was not kept byte for byte");
        }
        Err(error) => {
            assert!(!valid, "{text:?} was refused: {error}");
            assert!(is_own_variant(&error), "{error:?}");
            let reason = match &error {
                Error::InvalidKey(reason)
                | Error::InvalidConsumer(reason)
                | Error::InvalidScope(reason) => reason,
                other => panic!("{other:?} is not a validation error"),
            };
            match reason {
                Invalid::Empty => assert!(text.is_empty()),
                Invalid::TooLong { len, max: limit } => {
                    assert_eq!((*len, *limit), (text.len(), max))
                }
                Invalid::ControlCharacter {
                    character,
                    position,
                } => {
                    assert!(character.is_control());
                    assert!(text[*position..].starts_with(*character));
                    assert!(!text[..*position].chars().any(char::is_control));
                }
                other => panic!("{other:?} for a plain text"),
            }
            // The message names the reason; it does not repeat a long hostile text.
            assert!(error.to_string().len() < 100, "{error}");
        }
    }
}

/// A purpose key is accepted when every part is non-empty without `:` and the joined key is
/// a valid key; it then reads back into its parts.
fn purpose(parts: &[String]) {
    let joined = parts.join(":");
    let parts_ok = parts.iter().all(|p| !p.is_empty() && !p.contains(':'));
    let key_ok =
        !joined.is_empty() && joined.len() <= Key::MAX_LEN && !joined.chars().any(char::is_control);
    match Key::purpose(parts) {
        Ok(key) => {
            assert!(parts_ok && key_ok, "{parts:?} was accepted as {key:?}");
            let read_back: Vec<&str> = key.as_str().split(Key::SEPARATOR).collect();
            assert_eq!(read_back, parts);
        }
        Err(error) => {
            assert!(!(parts_ok && key_ok), "{parts:?} was refused: {error}");
            assert!(matches!(error, Error::InvalidKey(_)), "{error:?}");
        }
    }
}

/// An identity and a step, when the parts make one; an empty scope is no scope.
fn identity(parts: &[String; 4]) -> Option<(Identity, &str)> {
    let [scope, consumer, key, step] = parts;
    let scope = if scope.is_empty() {
        Scope::none()
    } else {
        Scope::new(scope.as_str()).ok()?
    };
    let identity = Identity::new(
        scope,
        Consumer::new(consumer.as_str()).ok()?,
        Key::new(key.as_str()).ok()?,
    );
    Some((identity, step.as_str()))
}
