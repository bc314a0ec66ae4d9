//! Durations and sizes as users write them.

use anyhow::{Result, anyhow, bail};
use std::time::Duration;

/// `duration` as [`justonce_cli_support::parse_duration`] reads it, in its largest whole unit.
pub fn duration_text(duration: Duration) -> String {
    let millis = duration.as_millis();
    let (per_unit, unit) = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ]
    .into_iter()
    .find(|(per_unit, _)| millis > 0 && millis.is_multiple_of(*per_unit))
    .unwrap_or((1, "ms"));
    format!("{}{unit}", millis / per_unit)
}

/// `1048576`, `512KiB`, `1MiB`, `2MB`.
pub fn parse_size(text: &str) -> Result<usize> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: usize = number
        .parse()
        .map_err(|_| anyhow!("{text:?} is not a size such as 1MiB"))?;
    let unit_bytes = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        _ => bail!("{text:?} has an unknown unit: use B, KiB, MiB, GiB, KB, MB or GB"),
    };
    number
        .checked_mul(unit_bytes)
        .ok_or_else(|| anyhow!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use justonce_cli_support::parse_duration;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("3d").unwrap(), Duration::from_secs(259_200));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("3 weeks").is_err());
        assert_eq!(
            parse_duration("36500d").unwrap(),
            Duration::from_secs(36_500 * 86_400)
        );
        assert!(parse_duration("36501d").is_err());
        assert!(parse_duration("18446744073709551615ms").is_err());
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("-1").is_err());
        assert_eq!(duration_text(Duration::from_millis(2_500)), "2500ms");
        assert_eq!(duration_text(Duration::from_secs(7_200)), "2h");
    }
}
