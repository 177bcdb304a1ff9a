"""chatenv: LLM chats as Gymnasium reinforcement-learning environments.

The core package: chats (:class:`History`), chat templates with exact assistant masks, prefix-stable
tokenization, the policy-facing containers, and the embedded default model. It never imports the adapters
in the separate ``wrappers`` package.
"""

from chatenv._version import __version__
from chatenv.actions import ScoredAction
from chatenv.checker import CheckReport, EnvCheckError, check
from chatenv.containers import ChatHistory, LogProbs, Masks, Text, Tokens
from chatenv.envs import ChatEnv, TokenEnv
from chatenv.envs.fork import fork
from chatenv.errors import (
    AgentError,
    APIError,
    ChatEnvError,
    DistributedError,
    InferenceUnavailable,
    MCPServerError,
    MCPToolError,
    MissingDependencyError,
    ModelNotAvailableError,
    RunDirError,
    SandboxError,
    StepTimeout,
    TemplateError,
    TemplateNotPrefixStable,
    TemplateParseError,
    ToolCallError,
    VectorEnvDied,
)
from chatenv.history import History, apply_chat_template
from chatenv.models import load_default_model, load_default_tokenizer
from chatenv.padding import pad_sequences, unpad_sequences
from chatenv.rewards import (
    ToolReply,
    combine,
    exact_match,
    extract_answer,
    format_reward,
    numeric_match,
    tool_errors,
    tool_successes,
    used_tool,
)
from chatenv.rollout import branch_rollout, episodes, rollout, turns
from chatenv.rollout.records import EpisodeRecord, episode_records, records_view
from chatenv.sampling import SettingError, SettingTypeError, SettingValueError
from chatenv.spaces import ChatText, MessagesSpace, TokenIds
from chatenv.tasks import (
    ArithmeticTask,
    CalculatorArithmeticTask,
    DatasetTask,
    GuessNumberTask,
    PythonTask,
    RetrievalTask,
    RewardError,
    Task,
    TaskResponse,
    TaskStart,
    ToolTask,
    register,
)
from chatenv.templates import ChatTemplate, get_template, list_templates, register_template, resolve_template
from chatenv.templates.derive import TemplateDerivationError
from chatenv.templates.tool_calls import get_tool_format, list_tool_formats, register_tool_format
from chatenv.tokenization import ChatTokenizer, EncodedChat, TemplateWindowWarning, chat_tokenizer

__all__ = [
    "__version__",
    # chats and templates
    "History",
    "ChatTemplate",
    "apply_chat_template",
    "get_template",
    "list_templates",
    "register_template",
    "register_tool_format",
    "list_tool_formats",
    "get_tool_format",
    "resolve_template",
    # tokenization
    "ChatTokenizer",
    "EncodedChat",
    "chat_tokenizer",
    "TemplateWindowWarning",
    # containers
    "ChatHistory",
    "LogProbs",
    "Masks",
    "Text",
    "Tokens",
    "pad_sequences",
    "unpad_sequences",
    # envs, tasks, rewards
    "ChatEnv",
    "ScoredAction",
    "TokenEnv",
    "rollout",
    "episodes",
    "EpisodeRecord",
    "episode_records",
    "records_view",
    "turns",
    "fork",
    "branch_rollout",
    "register",
    "Task",
    "TaskResponse",
    "TaskStart",
    "ArithmeticTask",
    "GuessNumberTask",
    "DatasetTask",
    "RewardError",
    "combine",
    "exact_match",
    "extract_answer",
    "format_reward",
    "numeric_match",
    # tool-calling tasks and tool-use rewards
    "ToolTask",
    "CalculatorArithmeticTask",
    "PythonTask",
    "RetrievalTask",
    "ToolReply",
    "tool_successes",
    "tool_errors",
    "used_tool",
    # checking envs
    "check",
    "CheckReport",
    "EnvCheckError",
    # spaces
    "ChatText",
    "MessagesSpace",
    "TokenIds",
    # default model
    "load_default_model",
    "load_default_tokenizer",
    # errors
    "ChatEnvError",
    "MissingDependencyError",
    "ModelNotAvailableError",
    "TemplateError",
    "TemplateDerivationError",
    "TemplateNotPrefixStable",
    "TemplateParseError",
    "StepTimeout",
    "VectorEnvDied",
    "ToolCallError",
    "MCPServerError",
    "MCPToolError",
    "SandboxError",
    "SettingError",
    "SettingTypeError",
    "SettingValueError",
    "APIError",
    "AgentError",
    "RunDirError",
    "DistributedError",
    "InferenceUnavailable",
]
