//! Placeholder: filled in by the effects part of the simulator.

pub fn router(_args: &crate::Args) -> anyhow::Result<axum::Router> {
    Ok(axum::Router::new())
}
