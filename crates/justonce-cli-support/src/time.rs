//! Points in time as the commands take them: a duration ago, such as `2h`, or an RFC 3339
//! timestamp, such as `2026-12-02T09:00:00Z`.

use crate::parse_duration;
use anyhow::{Result, anyhow, bail};
use std::time::{Duration, SystemTime};

/// `2h` (that long before `now`) or an RFC 3339 timestamp with its offset.
pub fn parse_time(text: &str, now: SystemTime) -> Result<SystemTime> {
    let text = text.trim();
    if text.contains(['-', ':']) {
        return parse_rfc3339(text);
    }
    let ago = parse_duration(text).map_err(|_| {
        anyhow!("{text:?} is neither a duration such as 2h nor a time such as 2026-12-02T09:00:00Z")
    })?;
    Ok(now.checked_sub(ago).unwrap_or(SystemTime::UNIX_EPOCH))
}

/// How long before `now` `text` ([`parse_time`]) is; zero for a time after it.
pub fn parse_ago(text: &str, now: SystemTime) -> Result<Duration> {
    let time = parse_time(text, now)?;
    Ok(now.duration_since(time).unwrap_or(Duration::ZERO))
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM)`, at or after 1970.
fn parse_rfc3339(text: &str) -> Result<SystemTime> {
    let invalid = || anyhow!("{text:?} is not an RFC 3339 time such as 2026-12-02T09:00:00Z");
    let bytes = text.as_bytes();
    if bytes.len() < 20 || !matches!(bytes[10], b'T' | b't' | b' ') {
        bail!(invalid());
    }
    let number = |range: std::ops::Range<usize>| -> Result<i64> {
        let part = text.get(range).ok_or_else(invalid)?;
        if !part.bytes().all(|b| b.is_ascii_digit()) {
            bail!(invalid());
        }
        part.parse().map_err(|_| invalid())
    };
    let separators = [(4, b'-'), (7, b'-'), (13, b':'), (16, b':')];
    if separators.iter().any(|&(at, c)| bytes[at] != c) {
        bail!(invalid());
    }
    let (year, month, day) = (number(0..4)?, number(5..7)?, number(8..10)?);
    let (hour, minute, second) = (number(11..13)?, number(14..16)?, number(17..19)?);
    let mut rest = &text[19..];
    let mut nanos = 0;
    if let Some(fraction) = rest.strip_prefix('.') {
        let digits = fraction.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            bail!(invalid());
        }
        let kept = &fraction[..digits.min(9)];
        nanos = kept.parse::<u32>().map_err(|_| invalid())? * 10u32.pow(9 - kept.len() as u32);
        rest = &fraction[digits..];
    }
    let offset_seconds = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6
            && matches!(rest.as_bytes()[0], b'+' | b'-')
            && rest.as_bytes()[3] == b':' =>
        {
            let hours = number(text.len() - 5..text.len() - 3)?;
            let minutes = number(text.len() - 2..text.len())?;
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            sign * (hours * 3_600 + minutes * 60)
        }
        _ => bail!(invalid()),
    };
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        _ => bail!(invalid()),
    };
    if day < 1 || day > days_in_month || hour > 23 || minute > 59 || second > 60 {
        bail!(invalid());
    }
    let seconds = days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second
        - offset_seconds;
    let seconds = u64::try_from(seconds).map_err(|_| anyhow!("{text:?} is before 1970"))?;
    Ok(SystemTime::UNIX_EPOCH + Duration::new(seconds, nanos))
}

/// Days from 1970-01-01 to a civil date, after Howard Hinnant's `days_from_civil`.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let shifted_month = (month + 9) % 12;
    let day_of_year = (153 * shifted_month + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: u64, nanos: u32) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::new(seconds, nanos)
    }

    #[test]
    fn rfc_3339_times_read_in_utc_whatever_their_offset() {
        let now = at(0, 0);
        assert_eq!(parse_time("1970-01-01T00:00:00Z", now).unwrap(), at(0, 0));
        assert_eq!(
            parse_time("2026-12-02T11:27:40.123Z", now).unwrap(),
            at(1_796_210_860, 123_000_000)
        );
        assert_eq!(
            parse_time("2026-12-02T12:27:40.123+01:00", now).unwrap(),
            at(1_796_210_860, 123_000_000)
        );
        assert_eq!(
            parse_time("2000-02-29t00:00:00-00:30", now).unwrap(),
            at(951_784_200, 0)
        );
        for bad in [
            "2026-12-02",
            "2026-12-02T11:27:40",
            "2026-02-30T00:00:00Z",
            "2026-12-02T24:00:00Z",
            "2026-12-02T11:27:40.Z",
            "2026-12-02T11:27:40+0100",
            "1969-12-31T23:59:59Z",
            "2026-1a-02T11:27:40Z",
        ] {
            assert!(parse_time(bad, now).is_err(), "{bad:?} was taken");
        }
    }

    #[test]
    fn durations_count_back_from_now() {
        let now = at(10_000, 0);
        assert_eq!(parse_time("2h", now).unwrap(), at(2_800, 0));
        assert_eq!(parse_ago("2h", now).unwrap(), Duration::from_secs(7_200));
        assert_eq!(
            parse_ago("1970-01-01T02:46:00Z", now).unwrap(),
            Duration::from_secs(40)
        );
        assert_eq!(
            parse_ago("1970-01-01T03:00:00Z", now).unwrap(),
            Duration::ZERO,
            "a time after now is zero ago"
        );
        assert!(parse_time("yesterday", now).is_err());
    }
}
