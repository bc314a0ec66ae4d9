//! The `Retry-After` header, read the same way by the relay's destination and the retrying
//! client.

use std::time::{Duration, SystemTime};

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
