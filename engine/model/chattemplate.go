package model

// KeyChatTemplate is the GGUF metadata key of the model's chat template, a
// Jinja source as Hugging Face's tokenizer_config.json carries it.
const KeyChatTemplate = "tokenizer.chat_template"

// ChatTemplate returns the Jinja chat template stored in the model's file
// (tokenizer.chat_template), or "" when the file has none.
func (m *Model) ChatTemplate() string {
	if m == nil || m.file == nil {
		return ""
	}
	s, _ := m.file.String(KeyChatTemplate)
	return s
}
