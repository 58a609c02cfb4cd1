//! Fencing tokens: what they are, how they are written, and how they are read back.
//!
//! A token is a decimal integer in `0..=2^63-1` ("u63": it fits an `int64` in every
//! Kubernetes client, and a JSON number in every language without loss). It travels as the
//! string value of the `kubefence.io/token` annotation ([`crate::names::TOKEN_ANNOTATION`]). The grammar is deliberately strict —
//! `0` or a non-zero ASCII digit followed by ASCII digits — because two spellings of one
//! number ("7" and "07") would let a writer dodge a string comparison somewhere downstream,
//! and a lenient parser is exactly where a stale write sneaks through.

use std::fmt;
use std::str::FromStr;

/// A fencing token: strictly increasing per lease, never reissued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(u64);

impl Token {
    /// The largest token: 2^63 - 1.
    pub const MAX: Token = Token(i64::MAX as u64);

    /// A token from a number, or `None` above [`Token::MAX`].
    pub const fn new(value: u64) -> Option<Token> {
        if value <= Self::MAX.0 { Some(Token(value)) } else { None }
    }

    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why a string is not a token. Each variant names the problem so the writer can fix it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the token is empty")]
    Empty,
    #[error("the token {0:?} contains whitespace; write the digits alone")]
    Whitespace(String),
    #[error("the token {0:?} has a sign; tokens are unsigned decimal integers")]
    Sign(String),
    #[error("the token {0:?} has a leading zero; write it without padding")]
    LeadingZero(String),
    #[error("the token {0:?} is not a decimal integer (found {1:?}); write ASCII digits 0-9 only")]
    NotDecimal(String, char),
    #[error("the token {0:?} is larger than 9223372036854775807 (2^63-1)")]
    Overflow(String),
}

impl FromStr for Token {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Token, TokenError> {
        let owned = || s.to_string();
        if s.is_empty() {
            return Err(TokenError::Empty);
        }
        if s.chars().any(char::is_whitespace) {
            return Err(TokenError::Whitespace(owned()));
        }
        if s.starts_with('+') || s.starts_with('-') {
            return Err(TokenError::Sign(owned()));
        }
        if let Some(bad) = s.chars().find(|c| !c.is_ascii_digit()) {
            return Err(TokenError::NotDecimal(owned(), bad));
        }
        if s.len() > 1 && s.starts_with('0') {
            return Err(TokenError::LeadingZero(owned()));
        }
        // 2^63-1 has 19 digits: anything longer overflows, and a 19-digit value is range-checked below.
        if s.len() > 19 {
            return Err(TokenError::Overflow(owned()));
        }
        let value: u64 = s.parse().map_err(|_| TokenError::Overflow(owned()))?;
        Token::new(value).ok_or_else(|| TokenError::Overflow(owned()))
    }
}

impl serde::Serialize for Token {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Token {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Token, D::Error> {
        let v = u64::deserialize(d)?;
        Token::new(v).ok_or_else(|| serde::de::Error::custom(format!("token {v} is larger than 2^63-1")))
    }
}

impl schemars::JsonSchema for Token {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Token".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "integer",
            "format": "int64",
            "minimum": 0,
        })
    }
    fn inline_schema() -> bool {
        true
    }
}
