use justonce_core::Error;

/// The names of justonce's tables, all starting with one validated prefix.
#[derive(Debug, Clone)]
pub struct Tables {
    pub(crate) prefix: String,
    pub(crate) keys: String,
    pub(crate) outbox: String,
    pub(crate) offsets: String,
    pub(crate) breakers: String,
    pub(crate) replays: String,
    pub(crate) duplicates: String,
    pub(crate) runs: String,
    pub(crate) migrations: String,
}

impl Tables {
    /// The longest prefix: PostgreSQL truncates identifiers at 63 bytes, and index names
    /// add up to 20 bytes to the prefix.
    pub(crate) const MAX_PREFIX_LEN: usize = 40;

    /// Validates `prefix` as a lowercase SQL identifier once, so that every statement built
    /// from it is safe to run as text.
    pub(crate) fn new(prefix: &str) -> Result<Self, Error> {
        let mut chars = prefix.chars();
        let starts_well = chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !starts_well || !rest_ok || prefix.len() > Self::MAX_PREFIX_LEN {
            return Err(Error::Config(format!(
                "table prefix {prefix:?} must be 1 to {} characters of a-z, 0-9 and _, \
                 not starting with a digit",
                Self::MAX_PREFIX_LEN
            )));
        }
        Ok(Self {
            prefix: prefix.to_owned(),
            keys: format!("{prefix}keys"),
            outbox: format!("{prefix}outbox"),
            offsets: format!("{prefix}offsets"),
            breakers: format!("{prefix}breakers"),
            replays: format!("{prefix}replays"),
            duplicates: format!("{prefix}duplicates"),
            runs: format!("{prefix}runs"),
            migrations: format!("{prefix}migrations"),
        })
    }

    /// `template` with `{prefix}` replaced by the validated prefix.
    pub(crate) fn render(&self, template: &str) -> String {
        template.replace("{prefix}", &self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_identifiers() {
        assert!(Tables::new("justonce_").is_ok());
        assert!(Tables::new("_t1_").is_ok());
        for bad in [
            "",
            "1a",
            "A_",
            "a-b",
            "a b",
            "a;drop",
            "x\"",
            &"a".repeat(41),
        ] {
            assert!(Tables::new(bad).is_err(), "{bad:?} was accepted");
        }
        let tables = Tables::new("app_").unwrap();
        assert_eq!(tables.keys, "app_keys");
        assert_eq!(
            tables.render("DELETE FROM {prefix}keys"),
            "DELETE FROM app_keys"
        );
    }
}
