//! Argument validation against a tool's JSON Schema.

use serde_json::Value;

use crate::error::ToolError;

/// A compiled schema of one tool.
pub(crate) struct ArgSchema {
    validator: jsonschema::Validator,
}

impl ArgSchema {
    /// Compiles `schema`; a bad schema is a programming error of the tool,
    /// reported as configuration.
    pub fn compile(tool: &str, schema: &Value) -> Result<Self, ToolError> {
        jsonschema::validator_for(schema)
            .map(|validator| ArgSchema { validator })
            .map_err(|e| {
                ToolError::Config(format!("schema of tool `{tool}` does not compile: {e}"))
            })
    }

    /// Every violation, joined, so the model can fix all of them at once.
    pub fn validate(&self, tool: &str, args: &Value) -> Result<(), ToolError> {
        let errors: Vec<String> = self
            .validator
            .iter_errors(args)
            .map(|e| {
                let path = e.instance_path().to_string();
                if path.is_empty() {
                    e.to_string()
                } else {
                    format!("{path}: {e}")
                }
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ToolError::InvalidArgs {
                tool: tool.to_string(),
                message: errors.join("; "),
            })
        }
    }
}
