"""The chat template of each tiny target family (eaglet.target.families): a simplified but faithful copy
of the real model's template, same markers and generation prompt, as Jinja text."""

# Llama 3.1 Instruct, shortened (no tools): the system header with the knowledge/date lines is
# always rendered, turns end with <|eot_id|>.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen2.5 Instruct without tools: a default system prompt when none is given.
QWEN2_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3 without tools: reasoning is rendered only for assistant turns after the last user query
# (earlier turns lose their <think> block), and enable_thinking=false pre-fills an empty one.
QWEN3_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') }}
                {{- '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Gemma 3 IT, text only: the system prompt is folded into the first user turn, the assistant
# role is called "model", roles must alternate.
GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") -}}
    {{ message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# DeepSeek-V3 without tools: system prompts go right after BOS, assistant turns end with EOS.
DEEPSEEK_V3_TEMPLATE = r"""{%- if not add_generation_prompt is defined %}
    {%- set add_generation_prompt = false %}
{%- endif %}
{%- set ns = namespace(system_prompt='', is_first_sp=true) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if ns.is_first_sp %}
            {%- set ns.system_prompt = ns.system_prompt + message['content'] %}
            {%- set ns.is_first_sp = false %}
        {%- else %}
            {%- set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}{{- ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

# GPT-OSS harmony format, shortened (no tools, no date line): a system message always, the
# system/developer prompt as a developer message, assistant answers on the "final" channel, the
# last assistant turn of a finished conversation ends with <|return|>, earlier ones with <|end|>.
# Reasoning is read from `thinking` and rendered on the "analysis" channel of the last turn only
# (earlier turns drop it); channel tags inside content or thinking are refused, as the real one does.
GPT_OSS_TEMPLATE = r"""{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n" }}
{{- "Knowledge cutoff: 2024-06\n\nReasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") }}
{{- "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {{- "<|start|>developer<|message|># Instructions\n\n" + messages[0].content + "\n\n<|end|>" }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- elif message.role == "assistant" %}
        {%- for field in ("content", "thinking") %}
            {%- if field in message and ("<|channel|>analysis<|message|>" in message[field]
                                         or "<|channel|>final<|message|>" in message[field]) %}
                {{- raise_exception("channel tags in the " + field + " field: "
                                    + "pass analysis in 'thinking', the final message in 'content'") }}
            {%- endif %}
        {%- endfor %}
        {%- if loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}
"""
