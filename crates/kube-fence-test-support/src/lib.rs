//! placeholder
pub mod history;
