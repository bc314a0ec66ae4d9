//! The `Retry-After` header, read the same way by the relay's destination and the retrying
//! client, and the one 4xx that says "not yet".

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use std::time::{Duration, SystemTime};

/// A `409` with `Retry-After` is an idempotent server's answer to a key whose first request
/// is still running (the IETF Idempotency-Key draft's, and `server`'s): that request may yet
/// succeed, so the key is sent again later rather than given up. A `409` without it is a
/// conflict that will not pass.
pub(crate) fn is_in_progress(status: StatusCode, headers: &HeaderMap) -> bool {
    status == StatusCode::CONFLICT && headers.contains_key(RETRY_AFTER)
}

/// `Retry-After` as delay-seconds or an HTTP date.
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    if let Ok(seconds) = value.trim().parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value.trim()).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_conflict_with_retry_after_is_in_progress() {
        let mut with = HeaderMap::new();
        with.insert(RETRY_AFTER, "1".parse().unwrap());
        assert!(is_in_progress(StatusCode::CONFLICT, &with));
        assert!(!is_in_progress(StatusCode::CONFLICT, &HeaderMap::new()));
        assert!(!is_in_progress(StatusCode::UNPROCESSABLE_ENTITY, &with));
    }

    #[test]
    fn retry_after_takes_seconds_and_dates() {
        assert_eq!(parse_retry_after("120"), Some(Duration::from_secs(120)));
        let later = SystemTime::now() + Duration::from_secs(3600);
        let parsed = parse_retry_after(&httpdate::fmt_http_date(later)).unwrap();
        assert!(parsed > Duration::from_secs(3500) && parsed <= Duration::from_secs(3600));
        assert_eq!(
            parse_retry_after("Thu, 01 Jan 1970 00:00:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }
}
