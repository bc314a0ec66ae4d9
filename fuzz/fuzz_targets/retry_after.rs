//! `Retry-After` as the relay's destination and the retrying client read it: delay-seconds
//! or an HTTP date, anything else ignored, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::time::{Duration, SystemTime};

// The parser is private to justonce-http and reached there only through a live HTTP
// answer; it is self-contained, so the file itself is compiled here.
#[path = "../../crates/justonce-http/src/retry_after.rs"]
mod retry_after;

fuzz_target!(|value: &str| {
    let before = SystemTime::now();
    let parsed = retry_after::parse_retry_after(value);
    let trimmed = value.trim();
    if let Ok(seconds) = trimmed.parse::<u64>() {
        assert_eq!(parsed, Some(Duration::from_secs(seconds)));
    } else if let Ok(date) = httpdate::parse_http_date(trimmed) {
        // A date is the time left until it, none once it has passed.
        let left = date.duration_since(before).unwrap_or(Duration::ZERO);
        let parsed = parsed.expect("an HTTP date was ignored");
        assert!(parsed <= left, "{parsed:?} is more than the {left:?} left");
    } else {
        assert_eq!(parsed, None, "{value:?} is neither seconds nor a date");
    }
});
